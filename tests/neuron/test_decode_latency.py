"""The paper's end-to-end experiment on trn1: dense vs compressed decode latency.

Llama-3.2-1B, keep_ratio 0.8, batch size 1, 32 prompt tokens -> 64 generated tokens, tp_degree 2.
Writes bench/results/neuron_decode_latency.json; prints the table. Numbers come only from a real
trn1 run of this test (none were measured when it was written).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from neuron_env import env_dir

from server.backends.base import SeqChunk
from server.backends.neuron.runner import NeuronRunner
from server.config import load_config

PROMPT, GENERATED, REPEATS = 32, 64, 5


def _decode_ms(runner, prompt):
    """Greedy-generate GENERATED tokens; returns (per-token decode latencies in ms, tokens)."""
    logits = runner.execute([SeqChunk(0, prompt, 0)])
    tokens, times = [int(logits.argmax())], []
    for i in range(GENERATED - 1):
        t0 = time.perf_counter()
        logits = runner.execute([SeqChunk(0, [tokens[-1]], PROMPT + i)])
        times.append((time.perf_counter() - t0) * 1e3)
        tokens.append(int(logits.argmax()))
    runner.release_slot(0)
    return times, tokens


@pytest.mark.device
@pytest.mark.slow
def test_dense_vs_compressed_decode_latency(tmp_path):
    model_dir = env_dir("NEURONMM_LLAMA_1B_DIR")
    artifact = env_dir("NEURONMM_LLAMA_1B_ARTIFACT")
    cfg = load_config("configs/llama-3.2-1b-trn1.yaml", {
        "engine.max_model_len": 128, "engine.max_num_seqs": 1, "neuron.context_buckets": [128],
        "neuron.batch_buckets": [1], "neuron.compile_cache": str(tmp_path / "cache")})
    prompt = torch.randint(100, 10000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    results = {}
    for name, compressed in (("dense", None), ("compressed", artifact)):
        runner = NeuronRunner(cfg, model_dir, compressed)
        runner.load()
        _decode_ms(runner, prompt)  # warm-up
        runs = [_decode_ms(runner, prompt)[0] for _ in range(REPEATS)]
        per_token = [statistics.median(r) for r in runs]
        results[name] = {"median_ms_per_token": statistics.median(per_token),
                         "total_ms_64_tokens": statistics.median(sum(r) for r in runs)}
        assert all(len(r) == GENERATED - 1 for r in runs)
    results["speedup"] = results["dense"]["median_ms_per_token"] / results["compressed"]["median_ms_per_token"]
    out = Path("bench/results/neuron_decode_latency.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "Llama-3.2-1B", "keep_ratio": 0.8, "batch_size": 1, "prompt_tokens": PROMPT,
                               "generated_tokens": GENERATED, "tp_degree": cfg.neuron.tp_degree, **results}, indent=2))
    print(json.dumps(results, indent=2))
    assert results["dense"]["median_ms_per_token"] > 0 and results["compressed"]["median_ms_per_token"] > 0
