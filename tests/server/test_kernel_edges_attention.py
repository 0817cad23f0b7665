"""Edges of the fused attention op (csrc/fused_ops.cpp, csrc/prefill_attention.cpp) the main tests leave out, each
against fused_ops.attention_ref: batch orders the op's contract allows, pools past int32 offsets, unwritten (NaN)
slots beside very different contexts, groups and head widths off the default model's, block edges, an empty batch."""

import math

import pytest
import torch

from server.models import fused_ops
from support import scattered_runs

pytestmark = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")

# fp32 sums in another order than SDPA's: ~1e-6 apart at these sizes (2e-5 leaves room for 3,000-position softmaxes);
# a bf16 model rounds q, the scores' inputs and the output to bf16 (2^-8 relative), so a few bf16 steps.
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _case(dtype, cache_dtype, head_dim: int, num_kv_heads: int, group: int, block_size: int,
          runs: list[tuple[int, int]], seed: int = 0, order: torch.Tensor | None = None) -> dict:
    """A batch of runs (prefix, tokens), each its own sequence with blocks scattered over the pool; `order`
    reorders the batch's tokens. Every slot no token's context covers holds NaN, as a never-written pool may."""
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    layout = scattered_runs(runs, block_size, g)
    num_blocks, tables, positions = layout.num_blocks, layout.tables, layout.positions
    seq_index, slot_mapping = layout.seq_index, layout.slot_mapping
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for s, (p, n) in enumerate(runs):
        seen = torch.arange(p + n)
        written[tables[s, seen // block_size].long() * block_size + seen % block_size] = True
    unwritten = (~written).view(num_blocks, 1, block_size, 1)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = [torch.randn(shape, generator=g).masked_fill(unwritten, float("nan")).to(cache_dtype) for _ in range(2)]
    angles = positions.float().unsqueeze(1) * (1e4 ** -torch.linspace(0, 1, head_dim // 2)).repeat(2)
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    case = dict(qkv=qkv.to(dtype), cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), k_cache=caches[0],
                v_cache=caches[1], slot_mapping=slot_mapping, block_tables=tables, seq_index=seq_index,
                context_lens=(positions + 1).int(), num_heads=num_heads, num_kv_heads=num_kv_heads,
                scale=1 / math.sqrt(head_dim))
    if order is not None:
        for name in ("qkv", "cos", "sin", "slot_mapping", "seq_index", "context_lens"):
            case[name] = case[name][order].contiguous()
    return case


def _check(case: dict, dtype) -> torch.Tensor:
    """The op against the reference: rotary and cache writes bit for bit, outputs within TOL; returns the output."""
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    ref_out, ref_q = fused_ops.attention_ref(*ref_case.values())
    assert torch.equal(q_rot, ref_q)
    for name in ("k_cache", "v_cache"):  # (as bytes: the unwritten NaNs compare equal)
        assert torch.equal(case[name].view(torch.uint8), ref_case[name].view(torch.uint8)), name
    assert not out.isnan().any()  # no unwritten slot was read
    torch.testing.assert_close(out, ref_out, rtol=TOL[dtype], atol=TOL[dtype])
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_two_runs_of_one_sequence_side_by_side_attend_as_the_reference(threads):
    """The op takes tokens in any order; here one sequence's positions 20..35, then 10..25, in one batch. Its prefill
    tiles once made both runs one work item sized by the second run's (shorter) context: the first run's scores ran
    past their share of the scratch (wrong outputs; a longer first run corrupted the heap)."""
    torch.set_num_threads(threads)
    order = torch.cat([torch.arange(20, 36), torch.arange(10, 26)])
    _check(_case(torch.float32, torch.float32, 64, 1, 1, 16, [(0, 36)], order=order), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pool_past_int32_element_offsets(dtype):
    """Blocks past 2^31 cache elements (an fp8 pool of 2 GiB a layer, allocated but never touched save the blocks
    used): every offset into the cache is 64-bit, for the token-by-token path and (fp32) the prefill tiles."""
    num_kv_heads, block_size, head_dim = 2, 16, 64
    small = _case(dtype, torch.float8_e4m3fn, head_dim, num_kv_heads, 3, block_size, [(40, 1), (20, 9), (3, 1)])
    base = 2 ** 31 // (num_kv_heads * block_size * head_dim) + 7  # the first block used
    big = dict(small, block_tables=small["block_tables"] + base, slot_mapping=small["slot_mapping"] + base * block_size)
    for name in ("k_cache", "v_cache"):
        try:
            big[name] = torch.empty((base + small[name].shape[0], *small[name].shape[1:]), dtype=torch.float8_e4m3fn)
        except RuntimeError:  # (an allocator that refuses 2 GiB of address space)
            pytest.skip("cannot reserve a 2 GiB pool here")
        big[name][base:] = small[name]
    out = torch.ops.neuronmm.attention(*big.values())[0]
    assert torch.equal(out, _check(small, dtype))
    for name in ("k_cache", "v_cache"):
        assert torch.equal(big[name][base:].view(torch.uint8), small[name].view(torch.uint8))


F32, BF16, F16, FP8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn


@pytest.mark.parametrize("dtype,cache_dtype,head_dim,group,threads", [
    (F32, F32, 64, 5, 1), (F32, F16, 128, 7, 5), (F32, FP8, 64, 7, 2), (F32, BF16, 128, 5, 2), (BF16, BF16, 128, 5, 5),
    (BF16, BF16, 64, 7, 1), (BF16, FP8, 64, 5, 2), (BF16, FP8, 128, 7, 1)])
def test_decodes_of_very_different_lengths_beside_a_chunk(dtype, cache_dtype, head_dim, group, threads):
    """One batch: decodes at 1 and 3,000 positions and at a block's edges, a 20-token chunk; groups whose query heads
    split into a full register chunk and a remainder (5 = 4 + 1, 7 = 2 + 2 + 2 + 1); more threads than items and
    fewer; every slot past the contexts NaN."""
    torch.set_num_threads(threads)
    runs = [(2999, 1), (0, 1), (15, 1), (16, 1), (31, 20), (47, 1)]
    _check(_case(dtype, cache_dtype, head_dim, 1, group, 16, runs, seed=group), dtype)


@pytest.mark.parametrize("dtype,cache_dtype,head_dim,block_size", [
    (F32, F32, 24, 1), (BF16, BF16, 24, 24), (F32, FP8, 48, 24), (F32, F16, 48, 1), (F32, BF16, 96, 1),
    (BF16, BF16, 96, 24), (F32, F32, 256, 24), (BF16, FP8, 256, 1)])
def test_head_widths_off_the_vector_paths_and_blocks_not_of_16(dtype, cache_dtype, head_dim, block_size):
    """Head widths the 64/128 vector loops do not take (24: no 16-lane multiple, so no prefill tiles either),
    blocks of one position and of 24 (a 16-key run and a tail), contexts that end a position before, at and after
    a block's edge, and prefill runs that cross one."""
    runs = [(block_size - 1, 1), (block_size, 1), (2 * block_size, 1), (block_size - 1, 6), (3, 17)]
    _check(_case(dtype, cache_dtype, head_dim, 2, 3, block_size, runs, seed=head_dim + block_size), dtype)


def test_an_empty_batch_writes_nothing():
    case = _case(torch.float32, torch.float32, 64, 2, 2, 16, [(5, 1)])
    keys = case["k_cache"].clone()
    for name in ("qkv", "cos", "sin", "slot_mapping", "seq_index", "context_lens"):
        case[name] = case[name][:0]
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    assert out.shape == (0, 4 * 64) and q_rot.shape == (0, 4, 64)
    assert torch.equal(case["k_cache"].view(torch.uint8), keys.view(torch.uint8))

