"""The packed CPU linears (our bf16 and fp32 panel GEMMs, oneDNN's packed layout) compute F.linear, and the model picks them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.models.lowrank import LowRankLinear
from server.models.packed_linear import PackedLinear, PanelLinear, pack_linears, packing_available, panels_available

needs_panels = pytest.mark.skipif(not panels_available(torch.device("cpu"), torch.bfloat16),
                                  reason="the panel GEMM is built only on CPUs with AVX512-BF16")


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


@needs_panels
def test_pack_linears_uses_panels_for_bf16_and_keeps_low_rank_chains():
    """Dense and low-rank layers are packed as panels (odd K falls back to oneDNN); the output is unchanged."""
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 32, bias=False),
                          LowRankLinear(torch.randn(16, 32, generator=g), torch.randn(48, 16, generator=g)),
                          nn.Linear(48, 7, bias=False), nn.Linear(7, 5, bias=False)).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=g).bfloat16()
    with torch.no_grad():
        want = model(x).float()
    assert pack_linears(model, use_panels=True) == 4
    assert isinstance(model[0], PanelLinear)
    assert [type(m) for m in model[1]] == [PanelLinear, PanelLinear]
    assert isinstance(model[3], PackedLinear)  # K = 7 is odd: no panel pairs
    got = model(x).float()
    assert torch.allclose(got, want, rtol=0.05, atol=0.05)


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
def test_pack_linears_uses_fp32_panels_for_every_width():
    """In fp32 odd K needs no pairing: every dense and low-rank layer becomes panels; the output is unchanged."""
    g = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 32, bias=False),
                          LowRankLinear(torch.randn(16, 32, generator=g), torch.randn(48, 16, generator=g)),
                          nn.Linear(48, 7, bias=False), nn.Linear(7, 5, bias=False))
    x = torch.randn(4, 64, generator=g)
    with torch.no_grad():
        want = model(x)
    assert pack_linears(model, use_panels=True) == 4
    assert all(isinstance(m, PanelLinear) for m in (model[0], *model[1], model[2], model[3]))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


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
