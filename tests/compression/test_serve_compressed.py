"""End to end on the tiny model: compress (sequential, whitened), apply to HF and serving models, serve via the API."""

from __future__ import annotations

import httpx
import pytest
import torch

from compression.compress import CompressSettings, compress_model
from compression.evaluation.corpora import C4_EVAL_DOCUMENTS
from server.errors import ConfigError
from server.models.artifact import load_artifact
from server.models.compressed import apply_artifact_to_hf
from support import live_server, tiny_config


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny-k05"
    settings = CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2,
                                allocation="uniform")
    manifest = compress_model(tiny_model_dir, settings, out, model_id="tiny")
    return out, manifest


def test_manifest_records_ranks_errors_and_counts(artifact):
    out, manifest = artifact
    loaded, tensors = load_artifact(out)
    assert loaded == manifest
    mods = manifest.modules
    assert len(mods) == 2 * 3  # 2 layers x gate/up/down
    for name, info in mods.items():
        assert info.rank % 8 == 0 and 0 <= info.rel_error < 1
        assert tensors[f"{name}.A"].shape == (info.rank, info.in_features)
    assert manifest.parameters.model_after < manifest.parameters.model_before
    assert len(manifest.calibration.sha256) == 64 and manifest.calibration.samples == 4
    ids = manifest.calibration.document_ids
    assert ids and ids == sorted(set(ids))  # the documents calibration read, recorded for recovery
    # calibrated on none of the documents `neuronmm eval` scores C4 perplexity on
    assert manifest.calibration.excluded_documents == C4_EVAL_DOCUMENTS
    assert min(ids) >= C4_EVAL_DOCUMENTS


def test_apply_to_hf_matches_serving_model(artifact, tiny_model_dir):
    from transformers import LlamaForCausalLM

    from server.models.loader import load_llama

    out, _ = artifact
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    dense_logits = hf(torch.tensor([[5, 6, 7, 8]])).logits
    dense_params = sum(p.numel() for p in hf.parameters())
    apply_artifact_to_hf(hf, out, tiny_model_dir)
    low_logits = hf(torch.tensor([[5, 6, 7, 8]])).logits
    assert not torch.allclose(dense_logits, low_logits)
    served = load_llama(tiny_model_dir, 64, compressed=out)
    low_params = sum(p.numel() for p in hf.parameters())
    assert low_params < dense_params
    assert sum(p.numel() for p in served.parameters()) == low_params  # same factors in the serving model


def test_wrong_model_is_a_clear_error(artifact, tmp_path, tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from server.models.loader import load_llama

    out, _ = artifact
    torch.manual_seed(1)  # the tiny model is seed 0's: another seed makes other weights whatever ran before
    other = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_model_dir))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="wrong model"):
        load_llama(tmp_path / "other", 64, compressed=out)


def test_compressed_model_served_through_api(artifact, tiny_model_dir):
    out, _ = artifact
    cfg = tiny_config(tiny_model_dir)
    cfg.model.compressed = str(out)
    with live_server(cfg) as live:
        r = httpx.post(f"{live.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] > 0 and isinstance(body["choices"][0]["text"], str)
