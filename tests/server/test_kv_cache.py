"""The KV cache is never read where it was not written: uninitialised (NaN) memory cannot leak into outputs."""

import dataclasses

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


@KERNELS
@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_a_narrow_cache_under_an_fp32_model_keeps_its_logits(tiny_model_dir, fused, cache_dtype):
    """engine.kv_cache_dtype float16 / bfloat16 under float32: half the bytes a token, logits within the cache's
    rounding of the fp32 cache's over a prefill and decode steps (the reference path's SDPA chunks included)."""
    prompt = list(range(300, 340))
    runs = {}
    for name in ("auto", cache_dtype):
        runner = TorchRunner(tiny_model_dir, 64, "float32", num_threads=1, fused_kernels=fused, kv_cache_dtype=name)
        runner.load()
        runner.allocate_kv_blocks(8, 16)
        logits = [runner.execute([SeqChunk(-1, prompt, 0, block_table=[0, 1, 2, 3])])]
        logits += [runner.execute([SeqChunk(-1, [400 + i], 40 + i, block_table=[0, 1, 2, 3])]) for i in range(4)]
        runs[name] = (runner, torch.cat(logits))
    (dense, wide), (narrow, half) = runs["auto"], runs[cache_dtype]
    assert dense.cache.k[0].dtype == torch.float32 and narrow.cache.k[0].dtype == getattr(torch, cache_dtype)
    assert narrow.kv_bytes_per_token() * 2 == dense.kv_bytes_per_token()
    assert not torch.equal(half, wide)  # the cache did round
    tol = 5e-4 if cache_dtype == "float16" else 4e-3  # measured: 5e-5 and 4e-4 on logits of magnitude ~1
    torch.testing.assert_close(half, wide, rtol=tol, atol=tol)


@KERNELS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_cache_keeps_the_models_greedy_tokens_and_its_logits_close(tiny_model_dir, fused, dtype):
    """engine.kv_cache_dtype fp8 (e4m3): a byte a value, under an fp32 or a bf16 model; logits over a prefill and
    decode steps stay near the model-dtype cache's, and their argmax is the same."""
    prompt = list(range(300, 340))
    runs = {}
    for name in ("auto", "fp8"):
        runner = TorchRunner(tiny_model_dir, 64, dtype, num_threads=1, fused_kernels=fused, kv_cache_dtype=name)
        runner.load()
        runner.allocate_kv_blocks(8, 16)
        logits = [runner.execute([SeqChunk(-1, prompt, 0, block_table=[0, 1, 2, 3])])]
        logits += [runner.execute([SeqChunk(-1, [400 + i], 40 + i, block_table=[0, 1, 2, 3])]) for i in range(4)]
        runs[name] = (runner, torch.cat(logits))
    (model_cache, exact), (fp8, rounded) = runs["auto"], runs["fp8"]
    assert fp8.cache.k[0].dtype == torch.float8_e4m3fn
    assert fp8.kv_bytes_per_token() * getattr(torch, dtype).itemsize == model_cache.kv_bytes_per_token()
    assert not torch.equal(rounded, exact)  # the cache did round
    assert torch.equal(rounded.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(rounded, exact, rtol=0, atol=0.03)  # measured: 5e-3 (fp32), 9e-3 (bf16); logits ~1.3


def test_a_bf16_models_long_prefill_chunks_go_to_sdpa_beside_the_fused_decodes(tiny_model_dir):
    """Under the fused CPU ops a bf16 model sends prefill chunks of 256+ tokens to SDPA (faster there), shorter ones
    and decode tokens to the fused op, in one step: the logits stay the all-fused ones' (bf16 rounding apart)."""
    from server.models import fused_ops

    if not fused_ops.load():
        pytest.skip("the fused CPU ops cannot be built here")
    long_prompt, short_prompt = list(range(300, 600)), list(range(700, 740))
    runs = {}
    for name, threshold in (("sdpa", "default"), ("fused", None)):
        runner = TorchRunner(tiny_model_dir, 512, "bfloat16", num_threads=1)
        runner.load()
        if threshold is None:
            runner.model.use_kernels(dataclasses.replace(runner.model.kernels, sdpa_min_chunk=None))
        runner.allocate_kv_blocks(64, 16)
        batch = runner.build_batch([SeqChunk(-1, long_prompt, 0, block_table=list(range(20))),
                                    SeqChunk(-1, short_prompt, 0, block_table=list(range(20, 23)))])
        assert len(batch.sdpa_chunks) == (1 if threshold else 0)  # the 300-token chunk only
        first = runner.execute([SeqChunk(-1, long_prompt, 0, block_table=list(range(20))),
                                SeqChunk(-1, short_prompt, 0, block_table=list(range(20, 23)))])
        decode = runner.execute([SeqChunk(-1, [5], 300, block_table=list(range(20))),
                                 SeqChunk(-1, [6], 40, block_table=list(range(20, 23)))])
        runs[name] = torch.cat([first, decode]).float()
    assert torch.equal(runs["sdpa"].argmax(-1), runs["fused"].argmax(-1))
    torch.testing.assert_close(runs["sdpa"], runs["fused"], rtol=0, atol=0.03)  # measured: 4e-3 on logits ~1.5


def test_a_batch_marks_when_every_token_wants_logits(tiny_model_dir):
    """Decode steps (every token wants logits, in order) carry no gather index; a prefill's last token does."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", num_threads=1)
    runner.load()
    runner.allocate_kv(3)
    decode = runner.build_batch([SeqChunk(0, [5], 7), SeqChunk(2, [6], 3)])
    assert decode.logits_index is None
    prefill = runner.build_batch([SeqChunk(0, [5, 6, 7], 0), SeqChunk(2, [8], 3, False)])
    assert prefill.logits_index.tolist() == [2]
    scored = runner.build_batch([SeqChunk(0, [5, 6, 7], 0, True, None, True)])  # all_logits: every token, in order
    assert scored.logits_index is None
    logits = runner.execute([SeqChunk(0, [5], 7), SeqChunk(2, [6], 3)])
    assert logits.shape == (2, runner.vocab_size)


def test_rotary_tables_in_the_model_dtype_are_the_rows_cast(tiny_model_dir):
    """The tables cast once per dtype give the rows the per-step cast gave, and follow buffers replaced later."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", num_threads=1)
    runner.load()
    rotary, positions = runner.model.rotary, torch.tensor([0, 5, 63, 5])
    cos, sin = rotary.tables(positions, torch.bfloat16)
    assert torch.equal(cos, rotary.cos[positions].to(torch.bfloat16))
    assert torch.equal(sin, rotary.sin[positions].to(torch.bfloat16))
    rotary.cos = rotary.cos * 2  # as Module.to replaces a buffer
    cos, _ = rotary.tables(positions, torch.bfloat16)
    assert torch.equal(cos, rotary.cos[positions].to(torch.bfloat16))
