"""Feature-major activations: lowrank_matmul reading Xᵀ / writing packed Yᵀ, and the chain that links them."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_bf16_close

from neuronmm_kernels import cost_model as cm
from neuronmm_kernels import reference as ref
from neuronmm_kernels import tiling
from neuronmm_kernels.emulator import NKIRuleError, TensorSpec, nki, nl, run
from neuronmm_kernels.kernels.lowrank_matmul import lowrank_matmul
from neuronmm_kernels.kernels.swiglu import swiglu


@pytest.mark.parametrize("num_tokens,d_in,rank,d_out,opts", [
    (1, 256, 128, 512, {}),                                        # one chunk: no SBUF accumulator
    (77, 256, 256, 300, {"k_chunk": 1}),                           # chunk per tile, out tail < 512
    (50, 200, 128, 300, {"k_chunk": 1}),                           # in_features tail: a 72-row last tile
    (300, 1024, 384, 256, {"row_pack": 2, "k_chunk": 4, "token_block": 256}),  # token-block tail
    (5, 512, 256, 128, {"row_pack": 4, "k_chunk": 4}),
    (513, 384, 256, 512, {"k_chunk": 2, "group": 1}),              # one token past a 512 block, chunk tail
    (600, 512, 256, 256, {"row_pack": 2, "k_chunk": 2, "token_block": 1024, "group": 4}),  # 2 PSUM chunks
])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_feature_major_input_matches_reference(make, num_tokens, d_in, rank, d_out, opts, transpose_out):
    x, u, v = make(num_tokens, d_in, scale=1.0), make(d_in, rank), make(rank, d_out)
    y, trace = run(lowrank_matmul, np.ascontiguousarray(x.T), u, v, transpose_in=True, transpose_out=transpose_out,
                   **opts)
    assert_bf16_close(y, ref.lowrank_matmul(x, u, v, transpose_out))
    assert trace.count("transpose") == 0  # Xᵀ arrives with the contraction dim first: nothing to transpose
    assert sum(i.nbytes * i.count for i in trace.instrs if i.op == "store") == num_tokens * d_out * 2


def test_feature_major_loads_whole_row_groups():
    """Each chunk loads Xᵀ and U as `row_pack` adjacent whole rows per partition, once per token block."""
    t, d_in, rank, d_out = 512, 2048, 1280, 512
    spec = [TensorSpec((d_in, t), ref.BF16), TensorSpec((d_in, rank), ref.BF16), TensorSpec((rank, d_out), ref.BF16)]
    _, tr = run(lowrank_matmul, *spec, trace_only=True, transpose_in=True, row_pack=4, k_chunk=8, token_block=512)
    loads = [i for i in tr.instrs if i.op == "load"]
    u_loads = [i for i in loads if i.free == 4 * rank]
    x_loads = [i for i in loads if i.free == 4 * t]
    assert u_loads and all(i.contig == 4 * rank * 2 for i in u_loads)
    assert x_loads and all(i.contig == 4 * t * 2 for i in x_loads)
    assert sum(i.nbytes * i.count for i in u_loads) == d_in * rank * 2  # U read once
    assert sum(i.nbytes * i.count for i in x_loads) == d_in * t * 2


def test_packed_transposed_stores_match_and_run_whole_rows(make):
    x, u, v = make(77, 256, scale=1.0), make(256, 256), make(256, 1024)
    y, tr = run(lowrank_matmul, x, u, v, transpose_out=True, out_pack=4, out_block=512)
    assert_bf16_close(y, ref.lowrank_matmul(x, u, v, True))
    assert {i.contig for i in tr.instrs if i.op == "store"} == {4 * 77 * 2}
    y, _ = run(lowrank_matmul, np.ascontiguousarray(x.T), u, v, transpose_in=True, transpose_out=True, out_pack=2,
               out_block=512, k_chunk=1)
    assert_bf16_close(y, ref.lowrank_matmul(x, u, v, True))


@pytest.mark.parametrize("num_tokens", [3, 130])
def test_feature_major_chain_composes(make, num_tokens):
    """gate/up store Yᵀ, SwiGLU runs on [intermediate, tokens], down reads it as Xᵀ: the token-major result."""
    hidden, inter, rank = 256, 512, 128
    x = make(num_tokens, hidden, scale=1.0)
    gu, gv, uu, uv, du, dv = (make(hidden, rank), make(rank, inter), make(hidden, rank), make(rank, inter),
                              make(inter, rank), make(rank, hidden))
    gT, _ = run(lowrank_matmul, x, gu, gv, transpose_out=True, out_pack=4)
    uT, _ = run(lowrank_matmul, x, uu, uv, transpose_out=True)
    hT, _ = run(swiglu, gT, uT, row_pack=2)
    y, _ = run(lowrank_matmul, hT, du, dv, transpose_in=True, row_pack=2, k_chunk=2)
    h = ref.swiglu(ref.lowrank_matmul(x, gu, gv), ref.lowrank_matmul(x, uu, uv))
    assert_bf16_close(hT, np.ascontiguousarray(h.T))
    assert_bf16_close(y, ref.lowrank_matmul(h, du, dv))


def test_swiglu_row_pack_matches_reference(make):
    g, u = make(512, 77, scale=2.0), make(512, 77, scale=1.0)
    h, tr = run(swiglu, g, u, row_pack=2, col_block=64)
    assert_bf16_close(h, ref.swiglu(g, u))
    with pytest.raises(AssertionError):  # 300 rows are not whole groups of 256
        run(swiglu, make(300, 8, scale=1.0), make(300, 8, scale=1.0), row_pack=2)


def test_feature_major_options_are_checked(make):
    xT, u, v = make(256, 4, scale=1.0), make(256, 128), make(128, 128)
    with pytest.raises(AssertionError):  # its own chunked U schedule: no u_moving
        run(lowrank_matmul, xT, u, v, transpose_in=True, u_moving=True)
    with pytest.raises(AssertionError):  # 256 rows are not whole groups of 512
        run(lowrank_matmul, xT, u, v, transpose_in=True, row_pack=4, k_chunk=4)
    with pytest.raises(AssertionError):  # packed Yᵀ rows need a transposed output
        run(lowrank_matmul, np.ascontiguousarray(xT.T), u, v, out_pack=2)


def test_strided_store_marks_only_the_elements_it_reaches():
    """A strided store into a kernel output counts as writing exactly the elements of its pattern."""
    x = np.arange(8 * 4, dtype=np.float32).reshape(4, 8)

    def rows_pair(t):
        out = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm)
        i_p, i_j, i_f = nl.arange(4)[:, None, None], nl.arange(2)[None, :, None], nl.arange(4)[None, None, :]
        tile = nl.load(t[i_p, 4 * i_j + i_f])  # (4, 2, 4): both halves of each row
        nl.store(out[2 * i_p + i_j, i_f], tile)  # partition p -> rows 2p, 2p+1 of out
        return out

    y, _ = run(nki.jit(rows_pair), x)
    assert np.array_equal(y, x.reshape(8, 4))

    def half(t):
        out = nl.ndarray((8, 4), nl.float32, buffer=nl.shared_hbm)
        i_p, i_f = nl.arange(4)[:, None], nl.arange(4)[None, :]
        nl.store(out[2 * i_p, i_f], nl.load(t[i_p, i_f]))  # the even rows only
        return out

    with pytest.raises(NKIRuleError) as err:
        run(nki.jit(half), x)
    assert err.value.rule == "err_tensor_output_not_written_to"


def test_selector_feature_major_candidates_and_minimum():
    """transpose_in selections carry the flag, reach the minimum over their candidates, and beat the
    token-major schedule at the shape that motivated them (Llama-3.2-1B's down projection, 512 tokens)."""
    dims = (1024, 256, 512)
    chosen = tiling.select_tiles("lowrank_matmul", 300, *dims, transpose_in=True)
    assert chosen["transpose_in"] is True
    best = cm.model_lowrank_matmul(300, *dims, tiles=chosen).total_us
    for tiles in tiling.candidates("lowrank_matmul", 300, transpose_in=True):
        try:
            us = cm.model_lowrank_matmul(300, *dims, tiles=tiles).total_us
        except (NKIRuleError, AssertionError):
            continue
        assert us * (1 + tiling.TIE_FRACTION) >= best - 1e-9
    with pytest.raises(ValueError):
        tiling.candidates("lowrank_mlp", 8, transpose_in=True)
    fm = cm.model_lowrank_matmul(512, 8192, 1280, 2048, transpose_in=True)
    tm = cm.model_lowrank_matmul(512, 8192, 1280, 2048)
    assert fm.total_us < tm.total_us and fm.hbm_bytes <= tm.hbm_bytes
    assert fm.engines_us["pe"] < tm.engines_us["pe"]  # the transposes are gone from TensorE
