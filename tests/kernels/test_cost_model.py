"""Cost model: calibration against AWS's published tutorial latencies, sampling exactness, monotonicity."""

from __future__ import annotations

import pytest

from bench.kernels import _mlp_roofline, roofline_us
from neuronmm_kernels import cost_model as cm
from neuronmm_kernels.emulator import TensorSpec, run
from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp
from neuronmm_kernels.kernels.tutorial_matmul import SCHEDULES
from neuronmm_kernels.reference import BF16


def test_calibration_within_20_percent_of_published_trn1_latencies():
    results = cm.calibration()
    assert set(results) == set(cm.TUTORIAL_MS)
    for name, (modeled_ms, published_ms) in results.items():
        assert abs(modeled_ms / published_ms - 1) < 0.20, (name, modeled_ms, published_ms)
    # and the ordering the tutorial teaches holds
    ms = [results[n][0] for n in ("tiled", "hoisted", "block_free", "fully_optimized")]
    assert ms == sorted(ms, reverse=True)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_loop_sampling_is_exact(name):
    shapes = [TensorSpec((1024, 2048), BF16), TensorSpec((1024, 2048), BF16)]
    kwargs = {"tiles_m": 4, "tiles_k": 4} if name == "fully_optimized" else {}
    _, full = run(SCHEDULES[name], *shapes, trace_only=True, sample_loops=False, **kwargs)
    _, sampled = run(SCHEDULES[name], *shapes, trace_only=True, **kwargs)
    assert len(sampled.instrs) < len(full.instrs)
    assert cm.model_trace(sampled).total_us == pytest.approx(cm.model_trace(full).total_us, rel=1e-9)
    assert sampled.hbm_bytes == full.hbm_bytes and sampled.matmul_flops == full.matmul_flops


def test_sampled_mlp_trace_matches_full_trace_with_tails():
    shapes = [(300, 256), (256, 128), (128, 640), (256, 128), (128, 640), (640, 256), (256, 256)]
    specs = [TensorSpec(s, BF16) for s in shapes]
    kw = {"token_block": 128, "gate_block": 256, "group": 1}
    _, full = run(lowrank_mlp, *specs, trace_only=True, sample_loops=False, **kw)
    _, sampled = run(lowrank_mlp, *specs, trace_only=True, **kw)
    assert cm.model_trace(sampled).total_us == pytest.approx(cm.model_trace(full).total_us, rel=1e-9)


def test_mlp_hbm_bytes_are_exactly_inputs_weights_output_at_decode():
    t, h, i, r = 1, 2048, 8192, 1280
    m = cm.model_lowrank_mlp(t, h, i, r)
    weights = 3 * r * (h + i) * 2
    assert m.hbm_bytes == weights + 2 * t * h * 2
    assert m.flops == 2 * t * 3 * r * (h + i)


@pytest.mark.parametrize("fn,args", [
    (cm.model_lowrank_mlp, lambda t, r: (t, 2048, 8192, r)),
    (cm.model_lowrank_matmul, lambda t, r: (t, 2048, r, 8192)),
])
def test_monotone_in_tokens_and_rank(fn, args):
    by_tokens = [fn(*args(t, 1280)).total_us for t in (1, 32, 128, 512, 2048)]
    assert by_tokens == sorted(by_tokens), by_tokens
    by_rank = [fn(*args(128, r)).total_us for r in (128, 512, 1280, 2048)]
    assert by_rank == sorted(by_rank), by_rank


def test_dma_bandwidth_curve():
    assert cm.dma_bandwidth(64) < cm.dma_bandwidth(256) == cm.dma_bandwidth(1024) < cm.dma_bandwidth(2048)
    assert cm.dma_bandwidth(4096) == cm.dma_bandwidth(1 << 20) == cm.DMA_BW_PEAK


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown MLP variant"):
        cm.model_mlp("sparse", 1, 128, 256, 128)


def test_smollm2_shape_is_modeled_and_bad_ranks_are_rejected():
    m = cm.model_lowrank_mlp(16, 576, 1536, (256, 256, 384))  # hidden 576 = 4.5 partition tiles
    assert m.total_us > 0 and m.hbm_bytes > 2 * 3 * 256 * (576 + 1536)
    with pytest.raises(ValueError, match="multiples of 128"):
        cm.model_lowrank_mlp(16, 576, 1536, 200)
    with pytest.raises(ValueError, match="multiples of 128"):
        cm.model_lowrank_matmul(16, 576, 100, 1536)


def test_roofline_is_the_slower_of_peak_compute_and_minimal_traffic():
    assert roofline_us(cm.PEAK_FLOPS, 0) == pytest.approx(1e6)          # 1 s of peak flops
    assert roofline_us(0, cm.DMA_BW_PEAK) == pytest.approx(1e6)         # 1 s of peak DMA
    decode = _mlp_roofline(1, {"hidden": 256, "intermediate": 512, "rank": 128})
    assert 0 < decode["of_roofline"] <= 1 and decode["bytes_over_min"] >= 1
