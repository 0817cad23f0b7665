"""The packed CPU linears (our bf16 and fp32 panel GEMMs, oneDNN's packed layout) compute F.linear, and the model picks them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.models import gemm_tuning
from server.models.gemm_tuning import threshold_from
from server.models.lowrank import LowRankLinear
from server.models.llama import StackedPair
from server.models.packed_linear import (FactoredPanelLinear, PackedLinear, PanelLinear, pack_linears, packing_available,
                                         panels_available)

needs_panels = pytest.mark.skipif(not panels_available(torch.device("cpu"), torch.bfloat16),
                                  reason="the panel GEMM is built only on CPUs with AVX512-BF16")


needs_amx = pytest.mark.skipif(not (panels_available(torch.device("cpu"), torch.bfloat16) and gemm_tuning.amx_available()),
                               reason="the AMX path runs only on CPUs with AMX (Sapphire Rapids and later)")


@pytest.fixture
def bf16_paths():
    """Sets the bf16 GEMMs' (FMA, AMX) row thresholds for one test; restores what this process had tuned after."""
    if not panels_available(torch.device("cpu"), torch.bfloat16):
        yield None
        return
    op = torch.ops.neuronmm

    def use(fma_from: int, amx_from: int = 0) -> None:
        op.set_bf16_fma_rows(fma_from)
        op.set_bf16_amx_rows(amx_from)

    before = gemm_tuning.bf16_kernels() or gemm_tuning.Bf16Kernels(0, 0)
    yield use
    use(before.fma_rows, before.amx_rows)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 products and sums of the bf16 operands, rounded once to bf16 (what both GEMMs promise)."""
    return F.linear(x.float(), w.float()).to(torch.bfloat16)


@needs_panels
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 49, 100])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (70, 130), (33, 2)])
def test_panel_linear_equals_fp32_reference(rows, out_features, in_features):
    """Every row count (register tiles of 12, work items of 48) and ragged N; one bf16 rounding apart at most."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    got = PanelLinear(w)(x)
    want = _reference(x, w)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    # the sums differ only in order: at most one bf16 step (2^-7 relative) apart
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-3), (got - want).abs().max()


@needs_panels
def test_panel_linear_takes_strided_and_batched_inputs():
    """A column slice (StackedPair's split) and a 3-d input give the same rows as contiguous 2-d ones."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 64, generator=g).bfloat16()
    wide = torch.randn(6, 128, generator=g).bfloat16()
    lin = PanelLinear(w)
    strided = wide[:, 64:]
    assert not strided.is_contiguous()
    assert torch.equal(lin(strided), lin(strided.contiguous()))
    assert torch.equal(lin(strided.reshape(2, 3, 64)), lin(strided.contiguous()).reshape(2, 3, 40))


def _panel_dtypes():
    return [d for d in (torch.bfloat16, torch.float32) if panels_available(torch.device("cpu"), d)]


@pytest.mark.parametrize("dtype", _panel_dtypes())
def test_pack_linears_packs_every_layer_and_keeps_the_output(dtype):
    """Dense layers become panels (bf16 panels pair K, so odd K falls back to oneDNN; fp32 takes every width),
    the low-rank pair one factored call; the output is unchanged."""
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 32, bias=False),
                          LowRankLinear(torch.randn(16, 32, generator=g), torch.randn(48, 16, generator=g)),
                          nn.Linear(48, 7, bias=False), nn.Linear(7, 5, bias=False)).to(dtype)
    x = torch.randn(4, 64, generator=g).to(dtype)
    with torch.no_grad():
        want = model(x).float()
    assert pack_linears(model, use_panels=True) == 4
    assert isinstance(model[0], PanelLinear) and isinstance(model[2], PanelLinear)
    assert isinstance(model[1], FactoredPanelLinear) and model[1].splits == [16]
    assert isinstance(model[3], PackedLinear if dtype == torch.bfloat16 else PanelLinear)
    tol = dict(rtol=0.05, atol=0.05) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x).float(), want, **tol)


def _bf16_paths() -> list[tuple[int, int]]:
    """(FMA, AMX) thresholds that make every row count take one bf16 path: VDPBF16PS, FMAs, AMX where usable."""
    if not panels_available(torch.device("cpu"), torch.bfloat16):
        return []
    return [(0, 0), (1, 0)] + ([(0, 1)] if gemm_tuning.amx_available() else [])


@pytest.mark.parametrize("dtype,paths",
                         [(torch.float32, (0, 0))] * (torch.float32 in _panel_dtypes())
                         + [(torch.bfloat16, paths) for paths in _bf16_paths()])
@pytest.mark.parametrize("rows", [1, 5, 16, 49])
@pytest.mark.parametrize("rank", [32, 34])
def test_factored_linear_equals_its_two_gemms(bf16_paths, dtype, paths, rows, rank):
    """Gate/up sharing a first GEMM (a low-rank part with ragged N, a dense part passed through: written by the
    first GEMM when it starts on a 32-column panel, copied out of it when not) and a lone low-rank linear: each
    equals x·Fᵀ rounded to the dtype, then each part's second GEMM (bf16: by each path; rank 34 is no whole AMX
    tile step, so that second GEMM takes a vector path)."""
    if dtype == torch.bfloat16:
        bf16_paths(*paths)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    a0, a1 = (torch.randn(n, 96, generator=g).div(10).to(dtype) for n in (rank, 70))
    b0 = torch.randn(50, rank, generator=g).div(6).to(dtype)
    t = F.linear(x.float(), torch.cat([a0, a1]).float()).to(dtype)
    want = torch.cat([F.linear(t[:, :rank].float(), b0.float()).to(dtype), t[:, rank:]], dim=1)
    pair = FactoredPanelLinear(torch.cat([a0, a1]), [rank, 70], [b0, None])
    lone = FactoredPanelLinear(a0, [rank], [b0])
    tol = dict(rtol=2 ** -6, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert pair(x).shape == (rows, 120) and torch.allclose(pair(x).float(), want.float(), **tol)
    assert torch.allclose(lone(x).float(), want[:, :50].float(), **tol)


@pytest.mark.parametrize("dtype", _panel_dtypes())
def test_parts_of_unequal_depth_are_all_computed(dtype):
    """Two low-rank parts of different ranks (the work split by cost, not by panel count) equal their GEMMs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g).to(dtype)
    a0, a1 = torch.randn(32, 64, generator=g).div(8).to(dtype), torch.randn(96, 64, generator=g).div(8).to(dtype)
    b0, b1 = torch.randn(160, 32, generator=g).div(6).to(dtype), torch.randn(160, 96, generator=g).div(6).to(dtype)
    t = F.linear(x.float(), torch.cat([a0, a1]).float()).to(dtype)
    want = torch.cat([F.linear(t[:, :32].float(), b0.float()), F.linear(t[:, 32:].float(), b1.float())], dim=1)
    pair = FactoredPanelLinear(torch.cat([a0, a1]), [32, 96], [b0, b1])
    tol = dict(rtol=2 ** -6, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(pair(x).float(), want.to(dtype).float(), **tol)


@pytest.mark.parametrize("dtype", _panel_dtypes())
def test_no_rows_give_an_empty_output(dtype):
    """A step can select no rows (no sequence wants logits): both GEMM ops return [0, N], not a crash."""
    g = torch.Generator().manual_seed(4)
    lin = PanelLinear(torch.randn(40, 64, generator=g).to(dtype))
    fact = FactoredPanelLinear(torch.randn(32, 64, generator=g).to(dtype), [32], [torch.randn(40, 32).to(dtype)])
    for module in (lin, fact):
        assert module(torch.empty(0, 64, dtype=dtype)).shape == (0, 40)


@pytest.mark.parametrize("dtype", _panel_dtypes())
def test_a_stacked_pair_packs_into_one_factored_call(dtype):
    g = torch.Generator().manual_seed(1)
    gate = LowRankLinear(torch.randn(32, 64, generator=g).div(8), torch.randn(96, 32, generator=g).div(6)).to(dtype)
    up = nn.Linear(64, 96, bias=False).to(dtype)
    model = nn.Sequential(StackedPair(gate, up))
    x = torch.randn(7, 64, generator=g).to(dtype)
    with torch.no_grad():
        want = model(x).float()
    assert pack_linears(model, use_panels=True) == 1
    assert isinstance(model[0], FactoredPanelLinear) and model[0].outs == [96, 96]
    assert torch.allclose(model(x).float(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", _panel_dtypes())
def test_factored_linear_rejects_parts_that_do_not_line_up(dtype):
    op = torch.ops.neuronmm.factored_linear
    pack = getattr(torch.ops.neuronmm, {torch.bfloat16: "pack_panels", torch.float32: "pack_panels_f32"}[dtype])
    first = pack(torch.randn(64, 32).to(dtype))
    with pytest.raises(RuntimeError, match="one entry per part"):
        op(torch.randn(2, 32).to(dtype), first, [32, 32], [None], [32, 32])
    with pytest.raises(RuntimeError, match="passes its slice through"):
        op(torch.randn(2, 32).to(dtype), first, [64], [None], [40])


needs_fp32_panels = pytest.mark.skipif(not panels_available(torch.device("cpu"), torch.float32),
                                       reason="the fp32 panel GEMM is built only on CPUs with AVX512F")


@needs_fp32_panels
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 16, 49, 100])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (70, 130), (33, 7)])
def test_fp32_panel_linear_equals_f_linear(rows, out_features, in_features):
    """Every row count (register tiles of 12, work items of 48), ragged N (32-column panels) and odd K."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    lin = PanelLinear(w)
    assert lin.layout == "fp32 panels"
    got = lin(x)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)  # summation order only


@needs_fp32_panels
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 12, 13, 16, 49, 100])
def test_bf16_weights_in_fp32_panels_equal_fp32_panels_of_their_values(rows):
    """bf16 weights under fp32 activations (a bf16 model on a CPU without native bf16) widen exactly: every row
    count and ragged N give the bits of the fp32 panels holding the same values, in one GEMM and factored."""
    g = torch.Generator().manual_seed(rows)
    for n, k in ((96, 64), (70, 130), (33, 7), (56, 40)):
        w = torch.randn(n, k, generator=g).bfloat16().float()
        x = torch.randn(rows, k, generator=g)
        narrow = PanelLinear(w, torch.bfloat16)
        assert narrow.panels.dtype == torch.bfloat16 and narrow.layout == "bf16 weights in fp32 panels"
        assert torch.equal(narrow(x), PanelLinear(w)(x))
    a, b = (torch.randn(*shape, generator=g).bfloat16().float() for shape in ((102, 64), (50, 32)))
    x = torch.randn(rows, 64, generator=g)
    pair = [FactoredPanelLinear(a, [32, 70], [b, None], panel_dtype) for panel_dtype in (torch.bfloat16, None)]
    assert pair[0].first.dtype == torch.bfloat16 and torch.equal(pair[0](x), pair[1](x))


@needs_fp32_panels
def test_panels_hold_bf16_weights_only_under_fp32_activations():
    with pytest.raises(ValueError, match="not built"):
        PanelLinear(torch.randn(32, 8).bfloat16(), torch.float32)


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 here")
def test_runner_panel_and_onednn_paths_agree(tiny_model_dir):
    """The whole tiny model through panels and through oneDNN: the same logits up to bf16 rounding."""
    outs = []
    for panel_gemm in (True, False):
        runner = TorchRunner(tiny_model_dir, 64, "bfloat16", panel_gemm=panel_gemm)
        runner.load()
        uses_panels = any(isinstance(m, PanelLinear) for m in runner.model.modules())
        assert uses_panels == (panel_gemm and panels_available(torch.device("cpu"), torch.bfloat16))
        runner.allocate_kv(2)
        logits = runner.execute([SeqChunk(slot=0, token_ids=[1, 5, 9, 3], start_pos=0),
                                 SeqChunk(slot=1, token_ids=[7, 2], start_pos=0)])
        outs.append(logits.float())
    assert torch.allclose(outs[0], outs[1], rtol=0.05, atol=0.05)


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32), reason="no oneDNN here")
def test_packing_after_a_forward_rebinds_the_layer_calls(tiny_model_dir):
    """The model binds its layers' projections at the first forward; packing afterwards must be seen by the next
    one (the packed modules run, and give the same logits)."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", pack_weights=False)
    runner.load()
    runner.allocate_kv(1)
    chunk = [SeqChunk(slot=0, token_ids=[1, 5, 9, 3], start_pos=0)]
    before = runner.execute(chunk)
    unpacked = runner.model.layer_calls()[0].o
    pack_linears(runner.model)
    calls = runner.model.layer_calls()[0]
    assert calls.o is not unpacked and isinstance(calls.o.__self__, PackedLinear)
    runner.release_slot(0)
    torch.testing.assert_close(runner.execute(chunk), before, rtol=1e-4, atol=1e-4)


def _check_bf16_kernels(rows: int, in_features: int = 130, rank: int = 24) -> None:
    """A dense and a factored call with strided parts, each one bf16 rounding from the fp32 reference."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    got = PanelLinear(w)(x)
    want = _reference(x, w)
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-3), (got - want).abs().max()
    a, b = torch.randn(rank, in_features, generator=g).bfloat16(), torch.randn(40, rank, generator=g).bfloat16()
    t = _reference(x, a)  # the factored call rounds its intermediate to bf16 as well
    torch.testing.assert_close(FactoredPanelLinear(a, [rank], [b])(x).float(), _reference(t, b).float(),
                               rtol=2 ** -7, atol=1e-2)


@needs_panels
@pytest.mark.parametrize("fma_from", [0, 1, 6])
@pytest.mark.parametrize("rows", [1, 5, 12, 16, 49])
def test_bf16_kernels_equal_the_fp32_reference(bf16_paths, fma_from, rows):
    """VDPBF16PS (0), fp32 FMAs at every row count (1) and the switch between them inside one call's row range (6)."""
    bf16_paths(fma_from)
    _check_bf16_kernels(rows)


@needs_amx
@pytest.mark.parametrize("amx_from", [1, 6])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 49, 100])
def test_amx_tiles_equal_the_fp32_reference(bf16_paths, amx_from, rows):
    """AMX from every row count (1) or from 6 (the vector paths below): one and two A tiles (16 / 32 rows), ragged
    row tails, K in whole tile steps (160) and, where it is not (130), the vector paths instead."""
    bf16_paths(4, amx_from)
    _check_bf16_kernels(rows, in_features=160, rank=64)
    _check_bf16_kernels(rows, in_features=130, rank=24)


@needs_amx
def test_amx_tiles_run_between_onednn_amx_calls(bf16_paths):
    """oneDNN configures AMX tiles on the same threads: our tiles are configured per call, not assumed."""
    bf16_paths(0, 1)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g).bfloat16()
    x = torch.randn(20, 256, generator=g).bfloat16()
    ours, onednn = PanelLinear(w), PackedLinear(w)
    want = _reference(x, w).float()
    for _ in range(3):
        assert torch.allclose(onednn(x).float(), want, rtol=2 ** -7, atol=1e-3)
        assert torch.allclose(ours(x).float(), want, rtol=2 ** -7, atol=1e-3)


def test_fma_threshold_is_the_smallest_row_count_it_wins_from():
    """The FMA path is chosen from the first row count where it wins at it and every larger one, by >= 5 %."""
    assert threshold_from({2: (30, 31), 4: (46, 32), 8: (86, 55), 16: (170, 106)}) == 4
    assert threshold_from({2: (30, 20), 4: (46, 47), 8: (86, 55), 16: (170, 106)}) == 8  # a win below a loss
    assert threshold_from({2: (30, 31), 4: (46, 45), 8: (86, 84), 16: (170, 168)}) == 0  # inside the noise
    assert threshold_from({2: (30, 10), 4: (46, 12)}) == 2


def test_amx_threshold_is_set_against_the_vector_path_in_use():
    """AMX must beat, by >= 5 %, whichever of VDPBF16PS and the FMAs would run at a row count, at it and above."""
    timings = {"dot": {2: 30, 4: 46, 8: 86, 16: 170}, "fma": {2: 31, 4: 32, 8: 55, 16: 106},
               "amx": {2: 29, 4: 40, 8: 23, 16: 23}}
    assert gemm_tuning.kernels_from(timings) == gemm_tuning.Bf16Kernels(fma_rows=4, amx_rows=8)  # 40 vs FMA's 32
    assert gemm_tuning.kernels_from({k: v for k, v in timings.items() if k != "amx"}).amx_rows == 0
    timings["amx"] = {2: 20, 4: 20, 8: 23, 16: 23}
    assert gemm_tuning.kernels_from(timings) == gemm_tuning.Bf16Kernels(fma_rows=4, amx_rows=2)
    assert "AMX tiles from 2 rows, VDPBF16PS below" == gemm_tuning.Bf16Kernels(4, 2).describe()
    assert "AMX tiles from 8 rows, fp32 FMAs from 4 rows, VDPBF16PS below" == gemm_tuning.Bf16Kernels(4, 8).describe()


def test_paths_are_timed_in_turns_so_a_burst_of_other_work_does_not_pick_the_slower():
    """Each rep times every path once, and a path's time is its fastest rep: another process busy through the
    later half of the timing (where a path timed after the other would have had all of its reps) slows both alike
    and neither's best."""
    selected, state = [], {"path": None, "calls": 0}
    cost_s = {"slow": 0.002, "fast": 0.001}

    def use(path):
        return lambda: (state.update(path=path), selected.append(path))

    def call():
        state["calls"] += 1
        time.sleep(cost_s[state["path"]] + (0.01 if state["calls"] > 34 else 0.0))  # the burst: from call 35 on

    us = gemm_tuning._fastest_us({"slow": use("slow"), "fast": use("fast")}, call, reps=30, warmup=2)
    assert selected[2:8] == ["slow", "fast"] * 3  # after one warm-up selection each, the paths take turns
    assert us["fast"] < 0.8 * us["slow"] and us["slow"] < 10_000


def test_thresholds_from_the_environment(monkeypatch, bf16_paths):
    """NEURONMM_BF16_FMA_ROWS / _AMX_ROWS fix the thresholds without timing; anything but a count >= 0 is refused,
    and so is AMX on a CPU without it."""
    monkeypatch.setattr(gemm_tuning, "_chosen", None)
    monkeypatch.setenv("NEURONMM_BF16_FMA_ROWS", "two")
    with pytest.raises(ValueError, match="NEURONMM_BF16_FMA_ROWS must be a row count"):
        gemm_tuning.tune_bf16_kernels()
    monkeypatch.setenv("NEURONMM_BF16_FMA_ROWS", "8")
    monkeypatch.setenv("NEURONMM_BF16_AMX_ROWS", "-2")
    with pytest.raises(ValueError, match="NEURONMM_BF16_AMX_ROWS must be a row count"):
        gemm_tuning.check_env()
    if not panels_available(torch.device("cpu"), torch.bfloat16):
        return
    monkeypatch.setenv("NEURONMM_BF16_AMX_ROWS", "4")
    if gemm_tuning.amx_available():
        assert gemm_tuning.tune_bf16_kernels() == gemm_tuning.Bf16Kernels(8, 4) == gemm_tuning.bf16_kernels()
    else:
        with pytest.raises(ValueError, match="no usable AMX"):
            gemm_tuning.tune_bf16_kernels()
    monkeypatch.setattr(gemm_tuning, "_chosen", None)
    monkeypatch.setenv("NEURONMM_BF16_AMX_ROWS", "0")
    assert gemm_tuning.tune_bf16_kernels() == gemm_tuning.Bf16Kernels(8, 0)


def test_the_timed_choice_is_kept_for_later_starts(monkeypatch, tmp_path, bf16_paths):
    """The first start times the paths and keeps the thresholds; a later start reads them instead of timing (the
    same kernels, the same greedy tokens); a file from another CPU model, or one that does not read, is timed over."""
    if bf16_paths is None:
        pytest.skip("no bf16 panel GEMMs in this build")
    for name in (gemm_tuning.FMA_ENV, gemm_tuning.AMX_ENV):
        monkeypatch.delenv(name, raising=False)
    amx = gemm_tuning.amx_available()
    timed = {path: {r: 100.0 for r in gemm_tuning.CANDIDATE_ROWS} for path in ("dot", "fma", "amx")}
    timed["fma"] = {2: 99.0, 4: 50.0, 8: 40.0, 16: 30.0}  # the FMA path from 4 rows
    if not amx:
        del timed["amx"]
    runs = []
    monkeypatch.setattr(gemm_tuning, "_timings", lambda amx_: runs.append(amx_) or timed)
    choice = tmp_path / "ext" / gemm_tuning.CHOICE_FILE

    monkeypatch.setattr(gemm_tuning, "_chosen", None)
    first = gemm_tuning.tune_bf16_kernels(choice)
    assert first.fma_rows == 4 and len(runs) == 1 and choice.is_file()
    assert gemm_tuning.read_choice(choice, amx) == first

    monkeypatch.setattr(gemm_tuning, "_chosen", None)
    assert gemm_tuning.tune_bf16_kernels(choice) == first and len(runs) == 1  # read, not timed

    saved = json.loads(choice.read_text())
    choice.write_text(json.dumps({**saved, "cpu": "another CPU"}))
    assert gemm_tuning.read_choice(choice, amx) is None
    for broken in ("{", json.dumps({**saved, "fma_rows": -1}), json.dumps({**saved, "amx_rows": "4"})):
        choice.write_text(broken)
        assert gemm_tuning.read_choice(choice, amx) is None
    assert gemm_tuning.read_choice(choice.with_name("absent.json"), amx) is None
    assert gemm_tuning.read_choice(tmp_path / "x.json", not amx) is None
    monkeypatch.setattr(gemm_tuning, "_chosen", None)
    gemm_tuning.tune_bf16_kernels(choice)
    assert len(runs) == 2 and gemm_tuning.read_choice(choice, amx) == first  # timed again and kept again


_AVX2_CHECK = """
import torch
from server.models import fused_ops
from server.models.packed_linear import FactoredPanelLinear, PanelLinear, panels_available
assert fused_ops.load(), "the x86-64-v3 build failed"
assert panels_available(torch.device("cpu"), torch.float32) and not panels_available(torch.device("cpu"), torch.bfloat16)
g = torch.Generator().manual_seed(0)
for rows in (1, 2, 3, 4, 7, 16, 49):  # whole-panel tiles to 3 rows, half-panel tiles of 6 and their tails
    for n, k in ((70, 130), (56, 40), (33, 2), (96, 64)):  # the last panel's second half: none, part, none, all
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        torch.testing.assert_close(PanelLinear(w)(x), x @ w.T, rtol=1e-5, atol=1e-4)
    a, b = torch.randn(24, 64, generator=g), torch.randn(40, 24, generator=g)
    torch.testing.assert_close(FactoredPanelLinear(a, [24], [b])(x), (x @ a.T) @ b.T, rtol=1e-5, atol=1e-4)
    a0, a1, b0 = torch.randn(32, 64, generator=g), torch.randn(70, 64, generator=g), torch.randn(50, 32, generator=g)
    pair = FactoredPanelLinear(torch.cat([a0, a1]), [32, 70], [b0, None])(x)  # the dense part writes into y
    torch.testing.assert_close(pair, torch.cat([(x @ a0.T) @ b0.T, x @ a1.T], dim=1), rtol=1e-5, atol=1e-4)
    # bf16 weights under fp32 activations: the bits of fp32 panels holding the same values
    for n, k in ((70, 130), (56, 40), (33, 2), (96, 64)):
        w, xk = torch.randn(n, k, generator=g).bfloat16().float(), torch.randn(rows, k, generator=g)
        assert torch.equal(PanelLinear(w, torch.bfloat16)(xk), PanelLinear(w)(xk)), (rows, n, k)
    a = torch.cat([a0, a1]).bfloat16().float()
    assert torch.equal(FactoredPanelLinear(a, [32, 70], [b0.bfloat16().float(), None], torch.bfloat16)(x),
                       FactoredPanelLinear(a, [32, 70], [b0.bfloat16().float(), None])(x))
print("ok")
"""


def test_avx2_build_serves_fp32_panels(avx2_ops_env):
    """A CPU without AVX-512 gets the fp32 panel GEMM in 8-wide FMAs and no bf16 panels: the ops built for
    x86-64-v3 (what such a CPU runs), in a fresh process, equal the fp32 products (register tiles of a whole
    panel to 3 rows, of half a panel beyond; strided column slices of y), and bf16 weights in them the fp32 ones."""
    done = subprocess.run([sys.executable, "-c", _AVX2_CHECK], env=avx2_ops_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

