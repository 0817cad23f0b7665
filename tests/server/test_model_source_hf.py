"""model.source: hf downloads one copy of the weights: the safetensors, or .bin where a repo has only those."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import huggingface_hub
import pytest

from server.config import ConfigError, ModelConfig
from server.models.source import resolve_model_dir

META_LLAMA = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
              "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model"]
BIN_ONLY = ["config.json", "tokenizer.json", "pytorch_model.bin", "flax_model.msgpack", "tf_model.h5"]
BOTH = ["config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub: snapshot_download writes the repo's files its ignore_patterns let through, as the real one."""
    repos = {"meta-llama/Llama-3.2-1B-Instruct": META_LLAMA, "old/bin-only": BIN_ONLY, "org/both": BOTH}
    calls = []

    def snapshot_download(repo_id, ignore_patterns=None):
        calls.append(repo_id)
        folder = tmp_path / repo_id.replace("/", "--")
        for name in repos[repo_id]:
            if not any(fnmatch.fnmatch(name, pattern) for pattern in ignore_patterns or []):
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                (folder / name).write_text("x")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _resolve(hf_id: str, tmp_path: Path) -> Path:
    return resolve_model_dir(ModelConfig(name="m", source="hf", hf_id=hf_id), tmp_path / "cache")


def test_meta_llamas_second_copy_is_not_downloaded(hub, tmp_path):
    folder = _resolve("meta-llama/Llama-3.2-1B-Instruct", tmp_path)
    assert _files(folder) == sorted(f for f in META_LLAMA if not f.startswith("original/"))
    assert len(hub) == 1


def test_safetensors_win_over_bin(hub, tmp_path):
    assert _files(_resolve("org/both", tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_repo_without_safetensors_gets_its_bin_weights_only(hub, tmp_path):
    folder = _resolve("old/bin-only", tmp_path)
    assert _files(folder) == ["config.json", "pytorch_model.bin", "tokenizer.json"]
    assert len(hub) == 2  # the second call only where the first found no safetensors


def test_an_unknown_repo_is_one_config_error(hub, tmp_path):
    with pytest.raises(ConfigError, match="model.hf_id: cannot fetch 'no/such'"):
        _resolve("no/such", tmp_path)
