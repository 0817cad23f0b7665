"""Emulated kernels vs reference.py over shapes with token tails, a single token and odd block sizes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_bf16_close

from neuronmm_kernels import reference as ref
from neuronmm_kernels.emulator import run
from neuronmm_kernels.kernels.dense_matmul import dense_matmul
from neuronmm_kernels.kernels.lowrank_matmul import lowrank_matmul
from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp
from neuronmm_kernels.kernels.swiglu import swiglu


@pytest.mark.parametrize("num_tokens,d_in,rank,d_out,opts", [
    (1, 256, 128, 512, {}),
    (77, 128, 256, 640, {}),                        # token tail < 128, out tail < 512
    (300, 384, 384, 1024, {"token_block": 256, "group": 2}),  # token-block tail, rank-group tail
    (513, 256, 128, 384, {"out_block": 1024}),       # one token past a 512 block
    (3, 256, 640, 512, {"u_moving": True}),          # decode schedule, rank tail within a 512 chunk
    (130, 128, 256, 256, {"u_moving": True, "token_block": 128}),
    (50, 200, 128, 300, {}),                         # in/out features not multiples of 128
    (2, 200, 128, 72, {"u_moving": True}),
    (300, 200, 256, 256, {"hoist_u": True, "token_block": 128, "group": 1}),
    (4, 256, 384, 128, {"hoist_u": True, "u_moving": True}),
    (3, 512, 640, 200, {"u_moving": True, "row_pack": 2}),      # two whole U rows per partition (decode)
    (130, 256, 256, 256, {"u_moving": True, "row_pack": 2, "token_block": 128}),  # token tail, packed X^T
    (150, 512, 256, 384, {"hoist_u": True, "row_pack": 2, "token_block": 128, "group": 1}),
    (2, 768, 128, 128, {"hoist_u": True, "u_moving": True, "row_pack": 3}),
    (800, 128, 128, 256, {"token_block": 768}),  # a 768-token block: PSUM chunks of 512 + 256, then a tail
])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_lowrank_matmul_matches_reference(make, num_tokens, d_in, rank, d_out, opts, transpose_out):
    x, u, v = make(num_tokens, d_in, scale=1.0), make(d_in, rank), make(rank, d_out)
    if transpose_out:
        opts = {k: (128 * 3 if k == "out_block" else val) for k, val in opts.items()}
    y, trace = run(lowrank_matmul, x, u, v, transpose_out=transpose_out, **opts)
    assert_bf16_close(y, ref.lowrank_matmul(x, u, v, transpose_out))
    # the (XU) strip never goes back to HBM: stores carry exactly the output
    stored = sum(i.nbytes for i in trace.instrs if i.op == "store")
    assert stored == num_tokens * d_out * 2


def test_row_pack_loads_whole_row_pairs_and_refuses_odd_shapes(make):
    """row_pack=2: each U load is two whole rows per partition (one DMA run of rank*4 bytes)."""
    from neuronmm_kernels.emulator import TensorSpec

    spec = [TensorSpec((1, 1024), ref.BF16), TensorSpec((1024, 1280), ref.BF16), TensorSpec((1280, 2048), ref.BF16)]
    _, tr = run(lowrank_matmul, *spec, trace_only=True, u_moving=True, row_pack=2, out_block=2048)
    u_loads = [i for i in tr.instrs if i.op == "load" and i.free == 2 * 1280]
    assert u_loads and all(i.contig == 1280 * 2 * 2 for i in u_loads)
    with pytest.raises(AssertionError):  # 200 features are not whole 256-row pairs
        run(lowrank_matmul, make(2, 200, scale=1.0), make(200, 128), make(128, 64), u_moving=True, row_pack=2)
    with pytest.raises(AssertionError):  # streamed stationary U would cut the packed rows: refused
        run(lowrank_matmul, make(2, 256, scale=1.0), make(256, 128), make(128, 64), row_pack=2)


@pytest.mark.parametrize("num_tokens,d_in,d_out", [(1, 128, 512), (129, 256, 384), (520, 128, 640), (3, 192, 100)])
def test_dense_matmul_matches_reference(make, num_tokens, d_in, d_out):
    x, w = make(num_tokens, d_in, scale=1.0), make(d_in, d_out)
    y, _ = run(dense_matmul, x, w)
    assert_bf16_close(y, ref.dense_matmul(x, w))


@pytest.mark.parametrize("num_tokens,hidden,inter,ranks,opts", [
    (1, 128, 256, (128, 128, 128), {}),
    (45, 256, 384, (128, 256, 128), {"gate_block": 256}),     # gate-block tail
    (200, 128, 256, (256, 128, 256), {"token_block": 128, "group": 1}),
    (5, 256, 256, (128, 640, 256), {"u_moving": True}),
    (140, 128, 384, (128, 128, 256), {"h_in_hbm": True, "gate_block": 256, "token_block": 128}),
    (3, 128, 256, (128, 128, 128), {"h_in_hbm": True, "u_moving": True}),
    (7, 192, 320, (128, 128, 256), {"gate_block": 256}),    # SmolLM2-like: hidden/intermediate tails
    (9, 192, 320, (128, 256, 128), {"u_moving": True, "h_in_hbm": True}),
    (130, 192, 256, (256, 128, 128), {"hoist_u": True, "token_block": 128}),
    (2, 128, 256, (128, 256, 128), {"hoist_u": True, "u_moving": True}),
    # prefill blocks over 512 tokens stream hᵀ a gate_block at a time (swiglu_down_streamed):
    (640, 128, 256, (128, 128, 128), {"token_block": 640, "gate_block": 128}),   # whole gate blocks, no tail
    (600, 128, 192, (128, 128, 128), {"token_block": 600, "gate_block": 256}),   # a tail only, no whole block
    (700, 192, 320, (128, 128, 256), {"token_block": 640, "gate_block": 128}),   # both, and a token-block tail
])
def test_lowrank_mlp_matches_reference(make, num_tokens, hidden, inter, ranks, opts):
    rg, ru, rd = ranks
    args = [make(num_tokens, hidden, scale=1.0), make(hidden, rg), make(rg, inter), make(hidden, ru),
            make(ru, inter), make(inter, rd), make(rd, hidden)]
    y, trace = run(lowrank_mlp, *args, **opts)
    assert_bf16_close(y, ref.lowrank_mlp(*args))
    # the [tokens, intermediate] activation stays on-chip unless spilled (then stored exactly once)
    spill = num_tokens * inter * 2 if opts.get("h_in_hbm") else 0
    assert sum(i.nbytes for i in trace.instrs if i.op == "store") == num_tokens * hidden * 2 + spill


def test_swiglu_matches_reference(make):
    g, u = make(130, 384, scale=2.0), make(130, 384, scale=1.0)
    h, _ = run(swiglu, g, u, col_block=256)
    assert_bf16_close(h, ref.swiglu(g, u))


def test_kernels_are_deterministic_and_detect_wrong_weights(make):
    x, u, v = make(64, 128, scale=1.0), make(128, 128), make(128, 256)
    y1, _ = run(lowrank_matmul, x, u, v)
    y2, _ = run(lowrank_matmul, x, u, v)
    assert np.array_equal(y1.view(np.uint16), y2.view(np.uint16))
    with pytest.raises(AssertionError):
        assert_bf16_close(y1, ref.lowrank_matmul(x, u, v[:, ::-1].copy()))


def test_random_shapes_and_schedules_match_reference():
    """A seeded sweep over token counts, non-128 dims and every schedule switch at once."""
    rng = np.random.default_rng(2026)
    for _ in range(6):
        t = int(rng.choice([1, 5, 127, 129, 300]))
        hidden, inter = int(rng.choice([64, 192, 256])), int(rng.choice([128, 200, 384]))
        rg, ru, rd = (int(rng.choice([128, 256])) for _ in range(3))
        opts = {"token_block": int(rng.choice([64, 128, 512])), "group": int(rng.choice([1, 2, 8])),
                "gate_block": int(rng.choice([128, 256])), "h_in_hbm": bool(rng.integers(2)),
                "hoist_u": bool(rng.integers(2))}
        opts["u_moving"] = bool(rng.integers(2)) and min(t, opts["token_block"]) <= 128

        def make(*shape, scale=None):
            return (rng.standard_normal(shape) * (scale or shape[0] ** -0.5)).astype(ref.BF16)

        args = [make(t, hidden, scale=1.0), make(hidden, rg), make(rg, inter), make(hidden, ru), make(ru, inter),
                make(inter, rd), make(rd, hidden)]
        y, _ = run(lowrank_mlp, *args, **opts)
        assert_bf16_close(y, ref.lowrank_mlp(*args))


@pytest.mark.parametrize("num_tokens", [1, 130])
def test_fp32_kernels_transpose_by_identity_matmul(num_tokens):
    """fp32 Xᵀ comes from matmuls against an identity (PE transposes of fp32 are inexact on trn1)."""
    rng = np.random.default_rng(num_tokens)
    x, w = rng.standard_normal((num_tokens, 200)).astype(np.float32), rng.standard_normal((200, 300)).astype(np.float32)
    y, trace = run(dense_matmul, x, w)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    transposes = [i for i in trace.instrs if i.op == "transpose"]
    assert transposes and all(i.engine == "pe" and i.fp32 for i in transposes)
    u, v = rng.standard_normal((200, 128)).astype(np.float32), rng.standard_normal((128, 64)).astype(np.float32)
    for opts in ({}, {"u_moving": True}):
        y, _ = run(lowrank_matmul, x, u, v, token_block=min(num_tokens, 128), **opts)
        np.testing.assert_allclose(y, x.astype(np.float64) @ u @ v, rtol=1e-4, atol=1e-3)
