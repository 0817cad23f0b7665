"""The tile selector picks the fastest feasible candidate and never an infeasible one."""

from __future__ import annotations

import pytest

from neuronmm_kernels import cost_model as cm
from neuronmm_kernels import tiling
from neuronmm_kernels.emulator import NKIRuleError
from neuronmm_kernels.emulator.core import PSUM_BANKS, SBUF_BYTES_PER_PARTITION


@pytest.mark.parametrize("num_tokens,hidden,inter,ranks", [
    (1, 2048, 8192, 1280),
    (512, 3072, 8192, 1792),
    (2048, 4096, 14336, (2048, 2048, 1536)),  # wide intermediate: hᵀ for 512 tokens would not fit
    (77, 256, 384, 128),
])
def test_selected_mlp_tiles_are_feasible(num_tokens, hidden, inter, ranks):
    tiles = tiling.select_tiles("lowrank_mlp", num_tokens, hidden, inter, ranks)
    m = cm.model_lowrank_mlp(num_tokens, hidden, inter, ranks, tiles=tiles)  # raises if infeasible
    assert m.peak_sbuf_bytes <= SBUF_BYTES_PER_PARTITION and m.peak_psum_banks <= PSUM_BANKS


def test_infeasible_candidates_exist_and_are_skipped():
    big = {"token_block": 512, "group": 8, "gate_block": 2048, "out_block": 4096}
    with pytest.raises(NKIRuleError) as err:
        cm.model_lowrank_mlp(2048, 4096, 14336, 2048, tiles=big)
    assert err.value.rule == "sbuf_capacity"
    chosen = tiling.select_tiles("lowrank_mlp", 2048, 4096, 14336, 2048)
    assert chosen != big


@pytest.mark.parametrize("kind,dims", [("lowrank_matmul", (1024, 256, 2048)), ("dense_matmul", (1024, 2048))])
def test_selection_is_the_minimum_over_feasible_candidates(kind, dims):
    """Up to the tie band, inside which the fewer HBM bytes win."""
    chosen = tiling.select_tiles(kind, 300, *dims)
    model = (cm.model_dense_matmul if kind == "dense_matmul" else cm.model_lowrank_matmul)
    best = model(300, *dims, tiles=chosen).total_us
    for tiles in tiling.candidates(kind, 300):
        assert model(300, *dims, tiles=tiles).total_us * (1 + tiling.TIE_FRACTION) >= best - 1e-9


def test_prefill_blocks_read_each_factor_about_once():
    """2048 tokens of Llama-3.2-1B's gate projection (rank 1280): the selected schedule moves X, U, V and Y
    close to once each (a 512-token block cap re-read U and V four times: 2.15x the minimum)."""
    t, d_in, r, d_out = 2048, 2048, 1280, 8192
    tiles = tiling.select_tiles("lowrank_matmul", t, d_in, r, d_out)
    minimal = 2 * (t * (d_in + d_out) + r * (d_in + d_out))
    assert tiles["token_block"] > 512
    assert cm.model_lowrank_matmul(t, d_in, r, d_out, tiles=tiles).hbm_bytes <= 1.1 * minimal


def test_selection_is_cached_and_validates_input():
    tiling.select_tiles("dense_matmul", 64, 512, 512)
    hits = tiling._select.cache_info().hits
    tiling.select_tiles("dense_matmul", 64, 512, 512)
    assert tiling._select.cache_info().hits == hits + 1
    with pytest.raises(ValueError):
        tiling.select_tiles("dense_matmul", 0, 512, 512)
    with pytest.raises(ValueError):
        tiling.select_tiles("conv", 1, 512, 512)


def test_spilling_h_makes_a_large_token_block_feasible():
    tiles = {"token_block": 512, "group": 8, "gate_block": 512, "out_block": 512}
    with pytest.raises(NKIRuleError):  # hᵀ for 512 tokens x 28672 intermediate = 224 KiB per partition
        cm.model_lowrank_mlp(1024, 4096, 28672, 2048, tiles=tiles)
    spilled = cm.model_lowrank_mlp(1024, 4096, 28672, 2048, tiles={**tiles, "h_in_hbm": True})
    assert spilled.peak_sbuf_bytes <= SBUF_BYTES_PER_PARTITION
