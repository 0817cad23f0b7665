"""A pruned artifact on the Neuron backend: the padded plain-Llama checkpoint tnx compiles (checked offline)."""

from __future__ import annotations

import json

import pytest
import torch

from compression.compress import CompressSettings
from compression.prune_artifact import prune_compress_model
from server.backends.neuron.pruned_checkpoint import pad_mlp, padded_width, write_pruned_checkpoint
from server.backends.neuron.runner import NeuronRunner
from server.config import load_config
from server.models.compressed import apply_artifact_to_hf


@pytest.fixture(scope="module")
def pruned(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prune") / "tiny-prune"
    settings = CompressSettings(method="prune", keep_ratio=0.5, rank_multiple=32, calib_samples=4, calib_seqlen=32,
                                batch_size=2)
    prune_compress_model(tiny_model_dir, settings, out, model_id="tiny")
    return out


def test_padded_width_is_the_widest_layer_in_whole_tiles_per_core():
    assert padded_width([1152, 640, 768], tp_degree=1) == 1152
    assert padded_width([1152, 640, 768], tp_degree=2) == 1280
    assert padded_width([100], tp_degree=1) == 128


def test_zero_padding_is_exact():
    g = torch.Generator().manual_seed(0)
    gate, up, down, x = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 8), (5, 8), (8, 5), (3, 8)))
    mlp = lambda a, b, c: (torch.nn.functional.silu(x @ a.T) * (x @ b.T)) @ c.T  # noqa: E731
    padded = pad_mlp(gate, up, down, 12)
    assert [tuple(t.shape) for t in padded] == [(12, 8), (12, 8), (8, 12)]
    h = torch.nn.functional.silu(x @ padded[0].T) * (x @ padded[1].T)
    assert torch.equal(h[:, 5:], torch.zeros(3, 7, dtype=h.dtype))  # padded channels are exactly zero
    torch.testing.assert_close(mlp(*padded), mlp(gate, up, down), rtol=1e-12, atol=1e-12)  # only sum order differs
    with pytest.raises(ValueError, match="cannot pad"):
        pad_mlp(gate, up, down, 4)


def test_checkpoint_is_the_pruned_model(pruned, tiny_model_dir, tmp_path):
    from transformers import LlamaForCausalLM

    out = write_pruned_checkpoint(tiny_model_dir, pruned, tmp_path / "ckpt", tp_degree=1)
    config = json.loads((out / "config.json").read_text())
    assert config["intermediate_size"] % 128 == 0
    plain = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    dense = hf(torch.tensor([[5, 6, 7, 8, 9]])).logits
    apply_artifact_to_hf(hf, pruned, tiny_model_dir)
    with torch.no_grad():
        want, got = hf(torch.tensor([[5, 6, 7, 8, 9]])).logits, plain(torch.tensor([[5, 6, 7, 8, 9]])).logits
    assert not torch.allclose(want, dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert write_pruned_checkpoint(tiny_model_dir, pruned, tmp_path / "ckpt", tp_degree=1) == out  # reused


def test_runner_compiles_the_padded_checkpoint_without_the_kernel_patch(pruned, tiny_model_dir, tmp_path):
    cfg = load_config("configs/llama-3.2-1b-trn1.yaml",
                      {"neuron.compile_cache": str(tmp_path / "cache"), "neuron.tp_degree": 1,
                       "engine.max_model_len": 256, "neuron.context_buckets": [128, 256]})
    seen = {}

    def factory(path, args, factors, hf_config):
        seen.update(path=path, factors=factors)
        return object()

    NeuronRunner(cfg, tiny_model_dir, pruned, model_factory=factory).load()
    assert seen["factors"] == {} and seen["path"] != tiny_model_dir
    assert (seen["path"] / "model.safetensors").is_file() and str(seen["path"]).startswith(str(tmp_path / "cache"))
