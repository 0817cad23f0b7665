"""The KV cache is never read where it was not written: uninitialised (NaN) memory cannot leak into outputs."""

import pytest
import torch

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner


# the fused CPU attention takes every chunk; the reference kernels hand long prefill chunks to SDPA
KERNELS = pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference-sdpa"])


@KERNELS
def test_batched_steps_stay_finite_over_nan_filled_cache(tiny_model_dir, fused):
    runner = TorchRunner(tiny_model_dir, 64, "float32", num_threads=1, fused_kernels=fused)
    runner.load()
    runner.allocate_kv(3)
    for t in runner.cache.k + runner.cache.v:
        t.fill_(float("nan"))
    # slot 1 idle, slots 0 and 2 at different lengths, one long prefill and one short
    logits = runner.execute([SeqChunk(0, list(range(5, 45)), 0), SeqChunk(2, [7, 8, 9], 0)])
    assert torch.isfinite(logits).all()
    logits = runner.execute([SeqChunk(0, [11], 40), SeqChunk(2, [12], 3)])
    assert torch.isfinite(logits).all()


@KERNELS
def test_a_chunk_after_cached_tokens_attends_like_one_prefill(tiny_model_dir, fused):
    """A 40-token chunk after 50 cached positions (prefix + causal chunk, merged) equals one 90-token prefill."""
    prompt = list(range(300, 390))
    runner = TorchRunner(tiny_model_dir, 128, "float32", num_threads=1, fused_kernels=fused)
    runner.load()
    runner.allocate_kv_blocks(16, 16)
    whole = runner.execute([SeqChunk(-1, prompt, 0, True, [0, 1, 2, 3, 4, 5])])
    runner.execute([SeqChunk(-1, prompt[:50], 0, False, [6, 7, 8, 9, 10, 11])])
    split = runner.execute([SeqChunk(-1, prompt[50:], 50, True, [6, 7, 8, 9, 10, 11])])
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-4)
