"""Golden outputs: the Neuron model (dense and compressed) against the torch CPU model, per bucket and batch size."""

from __future__ import annotations

import pytest
import torch
from neuron_env import env_dir

from server.backends.base import SeqChunk
from server.backends.neuron.runner import NeuronRunner
from server.backends.torch_runner import TorchRunner
from server.config import load_config

PROMPT_LENGTHS = [5, 100, 300]            # land in context buckets 128, 128, 512
BATCH_SIZES = [1, 4]                      # decode batches of 1 and 4 sequences, both run padded to 4


def _cfg(tmp_path):
    return load_config("configs/llama-3.2-1b-trn1.yaml", {
        "engine.max_model_len": 512, "engine.max_num_seqs": 4, "neuron.context_buckets": [128, 512],
        "neuron.batch_buckets": [1, 4], "neuron.tp_degree": 2, "neuron.compile_cache": str(tmp_path / "cache")})


def _prompts(n, length, vocab):
    g = torch.Generator().manual_seed(length * 31 + n)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def _step_logits(runner, prompts):
    """Prefill each prompt, then one batched decode step; returns (prefill logits, decode logits)."""
    pre = torch.cat([runner.execute([SeqChunk(s, p, 0)]) for s, p in enumerate(prompts)])
    nxt = pre.argmax(1).tolist()
    dec = runner.execute([SeqChunk(s, [t], len(p)) for s, (p, t) in enumerate(zip(prompts, nxt))])
    return pre, dec


@pytest.mark.device
@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "compressed"])
def test_neuron_matches_torch_cpu(tmp_path, compressed):
    model_dir = env_dir("NEURONMM_LLAMA_1B_DIR")
    artifact = env_dir("NEURONMM_LLAMA_1B_ARTIFACT") if compressed else None
    neuron = NeuronRunner(_cfg(tmp_path), model_dir, artifact)
    neuron.load()
    cpu = TorchRunner(model_dir, 512, "float32", "cpu", artifact)
    cpu.load()
    for batch in BATCH_SIZES:
        for length in PROMPT_LENGTHS:
            prompts = _prompts(batch, length, cpu.vocab_size)
            cpu.allocate_kv(batch)
            want_pre, want_dec = _step_logits(cpu, prompts)
            got_pre, got_dec = _step_logits(neuron, prompts)
            for got, want in ((got_pre, want_pre), (got_dec, want_dec)):
                assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.75, (batch, length)
                # bf16 weights/activations vs fp32 CPU: logits agree to a few percent of their spread
                assert (got - want).abs().max() <= want.std(), (batch, length)
    snap = neuron.padding.snapshot()
    assert {b for (phase, b) in snap if phase == "prefill"} == {128, 512}
    # tnx continuous batching pads every decode to batch_size_for_shared_caches (v0.13.0 base.py:500, 575-586)
    assert {b for (phase, b) in snap if phase == "decode"} == {4}
    assert snap[("decode", 4)]["padding"] == 3 * len(PROMPT_LENGTHS)  # the batch-1 steps
