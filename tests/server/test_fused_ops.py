"""The fused CPU ops equal their torch references (bit for bit where the maths is elementwise)."""

import math
import os
from pathlib import Path

import pytest
import torch

from server.models import fused_ops
from support import pytest_in_subprocess, scattered_runs

pytestmark = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_match_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(dtype)
    y = torch.randn(5, 64, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    # the sum of squares is reduced in another order than ATen's: equal up to the dtype's last bit
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(torch.ops.neuronmm.rms_norm(x, w, 1e-5), fused_ops.rms_norm_ref(x, w, 1e-5), **tol)
    x_ref = x.clone()
    out = torch.ops.neuronmm.add_rms_norm(x, y, w, 1e-5)
    torch.testing.assert_close(out, fused_ops.add_rms_norm_ref(x_ref, y, w, 1e-5), **tol)
    assert torch.equal(x, x_ref)  # the residual was updated in place, rounded as the reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(dtype):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours, ref = torch.ops.neuronmm.silu_mul(gate_up), fused_ops.silu_mul_ref(gate_up)
    # silu's exp differs from ATen's in the last fp32 bit; after rounding to bf16 nearly all agree
    torch.testing.assert_close(ours, ref, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)



@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_vector_and_scalar_loops_agree_bit_for_bit(dtype):
    """silu·up runs 8 or 16 lanes at a time (fp32 with AVX2 or AVX-512, bf16 with AVX512-BF16) and a scalar loop
    for the rest of a row: the same value in a lane (column r) and in the tail (column 16) gives the same bits,
    edge values included."""
    values = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 3.5, -3.5, 20.0, -20.0, 90.0, -90.0, 100.0, -100.0, 0.5, -0.5,
                           7.25, -7.25])
    gate = torch.randn(16, 17, generator=torch.Generator().manual_seed(5))
    gate[torch.arange(16), torch.arange(16)] = values
    gate[:, 16] = values
    up = torch.randn(16, 17, generator=torch.Generator().manual_seed(6))
    up[:, 16] = up[torch.arange(16), torch.arange(16)]
    out = torch.ops.neuronmm.silu_mul(torch.cat([gate, up], dim=1).to(dtype))
    assert torch.equal(out[torch.arange(16), torch.arange(16)], out[:, 16])


def _cache_case(dtype, block_size: int, num_blocks: int, cache_dtype=None):
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    g = torch.Generator().manual_seed(2)
    # two sequences: seq 0 has 5 cached + 1 new token, seq 1 a 3-token prefill chunk at position 0
    positions = torch.tensor([5, 0, 1, 2])
    seq_index = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    tables = torch.tensor([[3, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.int32)[:, :max(1, 8 // block_size)]
    blocks = tables[seq_index.long(), (positions // block_size)].long()
    slot_mapping = blocks * block_size + positions % block_size
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)
    v_cache = torch.randn(shape, generator=g).to(cache_dtype or dtype)
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    angles = positions.float().unsqueeze(1) * torch.linspace(0.1, 1.0, head_dim // 2).repeat(2)
    return dict(qkv=qkv, cos=angles.cos().to(dtype), sin=angles.sin().to(dtype), k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slot_mapping, block_tables=tables, seq_index=seq_index,
                context_lens=(positions + 1).int(), num_heads=num_heads, num_kv_heads=num_kv_heads,
                scale=1 / math.sqrt(head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_blocks", [(4, 4), (8, 4)])
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_attention_matches_reference(dtype, block_size, num_blocks, threads):
    """Both work splits (a token's KV heads together with few threads, one KV head each with many)."""
    torch.set_num_threads(threads)
    case = _cache_case(dtype, block_size, num_blocks)
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    ref_out, ref_q = fused_ops.attention_ref(*ref_case.values())
    assert torch.equal(q_rot, ref_q)  # rotary rounds exactly as the reference
    assert torch.equal(case["k_cache"], ref_case["k_cache"]) and torch.equal(case["v_cache"], ref_case["v_cache"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)


def _decode_case(dtype, head_dim: int, num_kv_heads: int, group: int, block_size: int, context_lens: list[int],
                 cache_dtype=None):
    """One decode token per sequence at position context_len - 1, each sequence's blocks scattered over the pool."""
    g = torch.Generator().manual_seed(3)
    num_heads, num_seqs = num_kv_heads * group, len(context_lens)
    max_blocks = max(-(-n // block_size) for n in context_lens)
    num_blocks = num_seqs * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks).int()
    positions = torch.tensor(context_lens) - 1
    slot_mapping = tables[torch.arange(num_seqs), positions // block_size].long() * block_size + positions % block_size
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    angles = positions.float().unsqueeze(1) * torch.linspace(0.1, 1.0, head_dim // 2).repeat(2)
    return dict(qkv=torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype),
                cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
                k_cache=torch.randn(shape, generator=g).to(cache_dtype or dtype),
                v_cache=torch.randn(shape, generator=g).to(cache_dtype or dtype),
                slot_mapping=slot_mapping, block_tables=tables, seq_index=torch.arange(num_seqs, dtype=torch.int32),
                context_lens=torch.tensor(context_lens, dtype=torch.int32), num_heads=num_heads,
                num_kv_heads=num_kv_heads, scale=1 / math.sqrt(head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (64, 2, 2), (64, 2, 4), (64, 2, 8), (128, 2, 2),
                                                       (128, 2, 3), (128, 1, 4), (128, 1, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_vectorised_attention_matches_reference(dtype, head_dim, num_kv_heads, group, block_size, threads):
    """Model head sizes (64, 128), where whole 16-key runs take the vector path and the rest the scalar tail,
    with groups that split into several register chunks."""
    torch.set_num_threads(threads)
    case = _decode_case(dtype, head_dim, num_kv_heads, group, block_size, [1, 15, 16, 17, 40, 71])
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    ref_out, ref_q = fused_ops.attention_ref(*ref_case.values())
    # rotary and the cache write at the models' head sizes round exactly as the reference
    assert torch.equal(q_rot, ref_q) and all(torch.equal(case[c], ref_case[c]) for c in ("k_cache", "v_cache"))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 3, 4])
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_a_groups_query_heads_attend_as_if_each_had_its_own_kv_head(cache_dtype, group, threads):
    """Query heads that share a KV head (the AVX2 loops widen each cached row once for the whole group) get the same
    bits as with a copy of that KV head each."""
    torch.set_num_threads(threads)
    num_kv_heads, head_dim = 2, 64
    shared = _decode_case(torch.float32, head_dim, num_kv_heads, group, 16, [1, 15, 16, 17, 40, 71], cache_dtype)
    q_width, kv_width = num_kv_heads * group * head_dim, num_kv_heads * head_dim
    qkv = shared["qkv"]
    heads = lambda x: x.view(x.shape[0], num_kv_heads, head_dim).repeat_interleave(group, 1).flatten(1)  # noqa: E731
    own = {**shared, "qkv": torch.cat([qkv[:, :q_width], heads(qkv[:, q_width:q_width + kv_width]),
                                       heads(qkv[:, q_width + kv_width:])], dim=1),
           "k_cache": shared["k_cache"].repeat_interleave(group, 1),
           "v_cache": shared["v_cache"].repeat_interleave(group, 1), "num_kv_heads": num_kv_heads * group}
    out_shared, _ = torch.ops.neuronmm.attention(*shared.values())
    out_own, _ = torch.ops.neuronmm.attention(*own.values())
    assert torch.equal(out_shared, out_own)


NARROW_CACHES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES)
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_attention_over_a_narrow_cache_under_fp32_matches_reference(cache_dtype, threads):
    """An fp32 model over an fp16 / bf16 cache (`engine.kv_cache_dtype`): the new keys and values are stored rounded
    to the cache's dtype, exactly as the reference stores them, and attention reads them widened (the scalar paths:
    head_dim 16)."""
    torch.set_num_threads(threads)
    case = _cache_case(torch.float32, 4, 4, cache_dtype)
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    ref_out, ref_q = fused_ops.attention_ref(*ref_case.values())
    assert case["k_cache"].dtype == cache_dtype and out.dtype == torch.float32
    assert torch.equal(q_rot, ref_q)
    assert torch.equal(case["k_cache"], ref_case["k_cache"]) and torch.equal(case["v_cache"], ref_case["v_cache"])
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES)
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (128, 2, 3), (128, 2, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_vectorised_attention_over_a_narrow_cache_matches_reference(cache_dtype, head_dim, num_kv_heads, group,
                                                                    block_size, threads):
    """The same on the vector paths (16-key runs on AVX-512, 8-key runs on AVX2), whose loads widen the cache (an fp8
    cache's keys and AVX2 values once for a group's heads, 16 rows at a time: blocks of 32 take two), and whose
    stores narrow it."""
    torch.set_num_threads(threads)
    case = _decode_case(torch.float32, head_dim, num_kv_heads, group, block_size, [1, 15, 16, 17, 40, 71],
                        cache_dtype)
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, _ = torch.ops.neuronmm.attention(*case.values())
    ref_out, _ = fused_ops.attention_ref(*ref_case.values())
    # the new rows stored as the reference rounds them (fp16 and fp8 by vector stores at these head sizes)
    assert torch.equal(case["k_cache"], ref_case["k_cache"]) and torch.equal(case["v_cache"], ref_case["v_cache"])
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (16, 2, 2)])
@pytest.mark.parametrize("threads", [1, 8], ids=["items-of-all-kv-heads", "items-of-one-kv-head"])
def test_attention_over_an_fp8_cache_under_bf16_matches_reference(head_dim, num_kv_heads, group, threads):
    """A bf16 model over an fp8 cache: stored as torch's cast stores it (saturating), attended like the reference."""
    torch.set_num_threads(threads)
    case = _decode_case(torch.bfloat16, head_dim, num_kv_heads, group, 16, [1, 15, 16, 17, 40, 71],
                        torch.float8_e4m3fn)
    case["qkv"][:2] *= 1000  # beyond fp8's +-448: saturated, not NaN
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, _ = torch.ops.neuronmm.attention(*case.values())
    ref_out, _ = fused_ops.attention_ref(*ref_case.values())
    for name in ("k_cache", "v_cache"):
        assert torch.equal(case[name].view(torch.uint8), ref_case[name].view(torch.uint8))
        assert not case[name].float().isnan().any()
    torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_fp8_cache_is_read_back_exactly(dtype):
    """Every finite e4m3fn value, subnormals and +-448 included, read back by the vector paths as torch widens it:
    keys all zero weigh 16 positions equally, and each value column holds one code among zeros, so a token's output
    is that code / 16 (exact in fp32 and bf16)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~codes.isnan()]  # 254 finite codes
    num_seqs, head_dim, block_size = 4, 64, 16
    column = torch.zeros(num_seqs * head_dim)
    column[:codes.numel()] = codes
    case = _decode_case(dtype, head_dim, 1, 1, block_size, [16] * num_seqs, torch.float8_e4m3fn)
    case["k_cache"].zero_()
    v = torch.zeros(case["v_cache"].shape)
    qkv = case["qkv"].float()
    qkv[:, head_dim:] = 0  # the new token's key and value: zero
    for s in range(num_seqs):
        row = int(case["slot_mapping"][s]) // block_size
        v[int(case["block_tables"][s, 0]), 0, s % (block_size - 1)] = column[s * head_dim:(s + 1) * head_dim]
        assert row == int(case["block_tables"][s, 0])  # one block a sequence: the codes sit beside its new token
    case["v_cache"] = v.to(torch.float8_e4m3fn)
    case["qkv"] = qkv.to(dtype)
    out, _ = torch.ops.neuronmm.attention(*case.values())
    expected = (column / 16).view(num_seqs, head_dim).to(dtype)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_fp8_cache_stores_every_value_as_torch_rounds_it(threads):
    """The vector store's rounding against torch's cast, where it can go wrong: every code, every midpoint between two
    (ties go to the even code), a float either side of each midpoint, subnormals, beyond +-448 (saturated), signs."""
    torch.set_num_threads(threads)
    codes = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:-1]  # 0 .. 448, NaN dropped
    mids = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([codes, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                        torch.tensor([449.0, 464.0, 465.0, 1e6, 3e38, 1e-12, 2.0 ** -10, 3 * 2.0 ** -11])])
    values = torch.cat([values, -values])
    head_dim, num_kv_heads = 64, 2
    per_token = num_kv_heads * head_dim
    values = torch.cat([values, torch.zeros(-values.numel() % per_token)]).view(-1, per_token)
    case = _decode_case(torch.float32, head_dim, num_kv_heads, 1, 16, [1] * values.shape[0], torch.float8_e4m3fn)
    case["qkv"][:, -per_token:] = values  # the new values, stored as they are (keys are rotated first)
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    torch.ops.neuronmm.attention(*case.values())
    fused_ops.attention_ref(*ref_case.values())
    for name in ("k_cache", "v_cache"):
        assert torch.equal(case[name].view(torch.uint8), ref_case[name].view(torch.uint8)), name


def _prefill_case(head_dim: int, num_kv_heads: int, group: int, block_size: int, runs: list[tuple[int, int]],
                  cache_dtype=torch.float32):
    """An fp32 batch of runs (prefix, tokens): each a sequence whose `tokens` new positions follow `prefix` cached
    ones (a prefill chunk; one token is a decode), its blocks scattered over the pool."""
    g = torch.Generator().manual_seed(4)
    num_heads = num_kv_heads * group
    layout = scattered_runs(runs, block_size, g)
    num_blocks, tables, positions = layout.num_blocks, layout.tables, layout.positions
    seq_index, slot_mapping = layout.seq_index, layout.slot_mapping
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    angles = positions.float().unsqueeze(1) * torch.linspace(0.1, 1.0, head_dim // 2).repeat(2)
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    return dict(qkv=qkv, cos=angles.cos(), sin=angles.sin(),
                k_cache=torch.randn(shape, generator=g).to(cache_dtype),
                v_cache=torch.randn(shape, generator=g).to(cache_dtype), slot_mapping=slot_mapping,
                block_tables=tables, seq_index=seq_index, context_lens=(positions + 1).int(), num_heads=num_heads,
                num_kv_heads=num_kv_heads, scale=1 / math.sqrt(head_dim))


# runs of 4 and more consecutive positions attend in tiles (prefill_attention.cpp); shorter ones token by token
PREFILL_RUNS = [(0, 37), (5, 1), (21, 4), (16, 16), (3, 3), (40, 9), (0, 1)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, *NARROW_CACHES])
@pytest.mark.parametrize("head_dim,num_kv_heads,group", [(64, 3, 3), (64, 2, 1), (64, 1, 8), (128, 2, 2),
                                                       (128, 1, 4), (80, 1, 5), (16, 2, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_chunks_attend_as_the_reference(cache_dtype, head_dim, num_kv_heads, group, block_size, threads):
    """An fp32 model's prefill chunks (in tiles of consecutive tokens: every key against all of a tile's query rows,
    with the causal mask inside the chunk) beside decodes and short runs (token by token), at head widths the tiles
    take (multiples of 16) and groups that fill a tile's 16 lanes unevenly (3 x 5, 5 x 3) or not at all (8 x 2)."""
    torch.set_num_threads(threads)
    case = _prefill_case(head_dim, num_kv_heads, group, block_size, PREFILL_RUNS, cache_dtype)
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, q_rot = torch.ops.neuronmm.attention(*case.values())
    ref_out, ref_q = fused_ops.attention_ref(*ref_case.values())
    assert torch.equal(q_rot, ref_q)
    assert torch.equal(case["k_cache"].view(torch.uint8), ref_case["k_cache"].view(torch.uint8))
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_of_runs_attend_as_the_reference(seed):
    """Random batches: runs of 1-40 tokens after 0-60 cached positions (where tiles start and end, and which tokens
    stay single, fall anywhere), random group and head width among those the tiles take, either block size."""
    rng = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=rng))]  # noqa: E731
    head_dim, (num_kv_heads, group) = pick([16, 64, 128]), pick([(1, 1), (2, 2), (3, 3), (1, 6), (2, 4)])
    runs = [(int(torch.randint(61, (1,), generator=rng)), int(torch.randint(1, 41, (1,), generator=rng)))
            for _ in range(int(torch.randint(1, 6, (1,), generator=rng)))]
    case = _prefill_case(head_dim, num_kv_heads, group, pick([16, 32]), runs, pick([torch.float32, torch.float16]))
    ref_case = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    out, _ = torch.ops.neuronmm.attention(*case.values())
    ref_out, _ = fused_ops.attention_ref(*ref_case.values())
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=lambda m: f"runs {runs}: {m}")


def test_a_prefill_chunk_attends_as_its_tokens_one_at_a_time():
    """A 37-token chunk (tiles) against the same tokens each sent alone as a decode over the cache the chunk wrote
    (token by token): the two paths agree to fp32 rounding, the causal mask included."""
    chunk = _prefill_case(64, 3, 3, 16, [(11, 37)])
    out, _ = torch.ops.neuronmm.attention(*chunk.values())
    alone = []
    for t in range(37):
        one = {**chunk, **{k: chunk[k][t:t + 1] for k in ("qkv", "cos", "sin", "slot_mapping", "seq_index",
                                                          "context_lens")}}
        alone.append(torch.ops.neuronmm.attention(*one.values())[0])
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_attention_rejects_a_cache_wider_or_other_than_the_model():
    for dtype, cache_dtype in [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                               (torch.float16, torch.float8_e4m3fn)]:
        case = _cache_case(dtype, 4, 4, cache_dtype)
        with pytest.raises(RuntimeError, match="fp16 / bf16 under fp32"):
            torch.ops.neuronmm.attention(*case.values())


def test_attention_skips_tokens_with_no_context():
    case = _cache_case(torch.float32, 4, 4)
    case["context_lens"] = torch.tensor([6, 0, 0, 0], dtype=torch.int32)
    out, _ = torch.ops.neuronmm.attention(*case.values())
    assert out[1:].abs().sum() == 0 and out[0].abs().sum() > 0


def test_attention_rejects_mismatched_widths():
    case = _cache_case(torch.float32, 4, 4)
    case["qkv"] = case["qkv"][:, :-2].contiguous()
    with pytest.raises(RuntimeError, match="qkv width"):
        torch.ops.neuronmm.attention(*case.values())


def test_build_targets_this_cpu_or_the_named_arch(monkeypatch, tmp_path):
    """-march=native by default; NEURONMM_CPU_ARCH names another target (x86-64-v3: the AVX2 code paths), and a
    different target is a different build in the cache."""
    monkeypatch.delenv("NEURONMM_CPU_ARCH", raising=False)
    assert "-march=native" in fused_ops.cxxflags() and "-ffp-contract=off" in fused_ops.cxxflags()
    native = fused_ops._build_dir(tmp_path)
    monkeypatch.setenv("NEURONMM_CPU_ARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in fused_ops.cxxflags() and "-march=native" not in fused_ops.cxxflags()
    assert fused_ops._build_dir(tmp_path) != native



@pytest.mark.skipif(os.environ.get("NEURONMM_CPU_ARCH") == "x86-64-v3", reason="this run is the x86-64-v3 build")
def test_the_avx2_build_passes_these_tests(avx2_ops_env, request):
    """Every test above and the sampler's fused-op tests again, in a process whose fused ops are built for
    x86-64-v3: the AVX2 code paths (8-wide attention, SiLU, argmax and sampling loops, the scalar loops where the
    AVX-512 code has vectors) a CPU without AVX-512 runs, which this machine's own build never does."""
    sampler_tests = [f"{Path(__file__).with_name('test_sampler.py')}::{name}" for name in (
        "test_fused_temperature_sampling_picks_the_torch_paths_token",
        "test_fused_temperature_sampling_never_picks_a_masked_token",
        "test_fused_temperature_sampling_draws_the_softmax_distribution", "test_fused_argmax_is_torchs_argmax")]
    done = pytest_in_subprocess(request.config, [__file__, *sampler_tests], avx2_ops_env)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
