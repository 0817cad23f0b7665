"""int8 weights (`--quantization int8`): the panel GEMM computes int8_linear_ref, the model packs into it, and the
served model's logits are the reference quantisation's."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner, check_quantization
from server.config import load_config
from server.errors import ConfigError
from server.models.int8_linear import (int8_available, int8_linear_ref, pack_int8_panels, quantize_linears_ref,
                                       quantize_rows_ref, quantize_weight)
from server.models.packed_linear import FactoredPanelLinear, PanelLinear, pack_linears, panels_available

needs_int8 = pytest.mark.skipif(not (panels_available(torch.device("cpu"), torch.float32) and int8_available()),
                                reason="the int8 panel GEMM is built only on CPUs with AVX512-VNNI")
_BF16 = panels_available(torch.device("cpu"), torch.bfloat16)
DTYPES = [torch.float32] + ([torch.bfloat16] if _BF16 else [])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 outputs within fp32 rounding of the float64 reference; bf16 ones within one bf16 rounding of it."""
    scale = want.abs().max().item()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3 * scale)


def test_quantisation_is_per_column_and_per_64_inputs():
    """A weight's columns each get their own scale; a row of x its own per 64 inputs, so an outlier coarsens only its
    block (a per-row scale would round the rest of the row to a few levels)."""
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [100.0, 50.0, -100.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_weight(w)
    assert q.tolist() == [[127, -64, 32, 0], [127, 64, -127, 1], [0, 0, 0, 0]]  # -63.5 rounds to even
    torch.testing.assert_close(scale, torch.tensor([1 / 127, 100 / 127, 0.0]))
    x = torch.full((1, 128), 0.01)
    x[0, 3] = 50.0
    r, x_scale = quantize_rows_ref(x)
    assert r[0, 64:].eq(127).all() and r[0, 3] == 127 and r[0, 0] == 0  # 0.01 against 50 in its block is 0
    torch.testing.assert_close(x_scale, torch.tensor([[50 / 127, 0.01 / 127]]))


def test_panels_are_the_codes_and_scales_in_the_kernels_layout():
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(0))
    panels = pack_int8_panels(w)
    assert panels.dtype == torch.uint8 and panels.shape == (2, 128 * 32 + 128)
    q, scale = quantize_weight(w)
    # panel 1, 4-input step 5, column 3 (column 35 of w): inputs 20..23, stored + 128
    assert panels[1, (5 * 32 + 3) * 4:(5 * 32 + 3) * 4 + 4].tolist() == (q[35, 20:24].int() + 128).tolist()
    assert torch.equal(panels[1, 128 * 32:].view(torch.float32)[:8], scale[32:])
    assert panels[1, 128 * 32:].view(torch.float32)[8:].eq(0).all()  # padding columns scale to 0
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_int8_panels(torch.randn(8, 96))


@needs_int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 48, 49, 100])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (70, 192), (33, 576)])
def test_panel_linear_int8_equals_the_reference(dtype, rows, out_features, in_features):
    """Register tiles of 6 rows, work items of 48 (x quantised per thread) and more rows (x quantised once), ragged N."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = (torch.randn(rows, in_features, generator=g) * 3).to(dtype)
    x[:, 7] = 40.0  # an outlier in the first block of every row
    got = PanelLinear(w, int8=True)(x)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    _close(got, int8_linear_ref(x, w))


@needs_int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 49])
def test_factored_int8_equals_its_two_gemms(dtype, rows):
    """X·U·V in one call (the intermediate rounded to x's dtype, then quantised per 64 inputs as x is), and a stacked
    pair whose second part passes through, its split unaligned to a panel (the slice copied out)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    a, b = torch.randn(64, 128, generator=g).to(dtype), torch.randn(70, 64, generator=g).to(dtype)
    t = int8_linear_ref(x, a).to(dtype)
    _close(FactoredPanelLinear(a, [64], [b], int8=True)(x), int8_linear_ref(t, b))
    a0, a1, b0 = (torch.randn(n, k, generator=g).to(dtype) for n, k in ((64, 128), (40, 128), (50, 64)))
    pair = FactoredPanelLinear(torch.cat([a0, a1]), [64, 40], [b0, None], int8=True)(x)
    t0 = int8_linear_ref(x, a0).to(dtype)
    want = torch.cat([int8_linear_ref(t0, b0), int8_linear_ref(x, a1)], dim=1)
    _close(pair, want)


def _logits(runner: TorchRunner) -> torch.Tensor:
    runner.allocate_kv(2)
    prefill = runner.execute([SeqChunk(slot=0, token_ids=[1, 5, 9, 3, 11], start_pos=0),
                              SeqChunk(slot=1, token_ids=[7, 2], start_pos=0)])
    decode = runner.execute([SeqChunk(slot=0, token_ids=[4], start_pos=5), SeqChunk(slot=1, token_ids=[8], start_pos=2)])
    return torch.cat([prefill.float(), decode.float()])


@needs_int8
def test_runner_int8_logits_are_the_reference_quantisations(tiny_model_dir):
    """The whole tiny model with int8 weights (fp32 activations): every projection and the LM head in int8 panels,
    the C++ layer loop and the Python one alike, and the logits those of the same model with each Linear through
    int8_linear_ref (prefill and decode)."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", quantization="int8")
    runner.load()
    layouts = [m.layout for m in runner.model.modules() if isinstance(m, (PanelLinear, FactoredPanelLinear))]
    assert layouts and all("int8" in layout for layout in layouts)
    assert runner.precision == "float32, int8 weights"
    served = _logits(runner)
    runner.model.use_decoder_plan = False
    assert torch.equal(_logits(runner), served)
    reference = TorchRunner(tiny_model_dir, 64, "float32", pack_weights=False)
    reference.load()
    assert quantize_linears_ref(reference.model, torch.float64) == 2 * 4 + 1  # qkv, o, gate-up, down in two layers; the LM head
    reference.model.unbind()
    want = _logits(reference)
    torch.testing.assert_close(served, want, rtol=0, atol=1e-4 * want.abs().max().item())
    dense = TorchRunner(tiny_model_dir, 64, "float32")
    dense.load()
    assert not torch.allclose(served, _logits(dense), rtol=0, atol=1e-4 * want.abs().max().item())  # it quantised


@needs_int8
def test_layers_whose_inputs_do_not_fit_keep_their_dtype():
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=False))
    pack_linears(model, use_panels=True, int8=True)
    assert [m.layout for m in model] == ["int8 panels", "int8 panels", "fp32 panels"]
    x = torch.randn(3, 128)
    torch.testing.assert_close(model(x), model[2](model[1](model[0](x))))


def test_quantization_is_a_cpu_option_of_the_torch_backend():
    assert check_quantization(None, torch.device("cuda")) is None
    assert check_quantization("int8", torch.device("cpu")) == "int8"
    with pytest.raises(ConfigError, match="not on cuda"):
        check_quantization("int8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="not supported"):
        check_quantization("int4", torch.device("cpu"))
    assert load_config(None, {"model.quantization": "int8"}).model.quantization == "int8"
    with pytest.raises(ConfigError, match="quantization"):
        load_config(None, {"model.quantization": "int4"})


_AVX2_INT8 = """
import torch
from server.models import fused_ops
assert fused_ops.load() and not hasattr(torch.ops.neuronmm, "panel_linear")  # the AVX2 build: no bf16 panels
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.models.int8_linear import int8_linear_ref, quantize_linears_ref
from server.models.packed_linear import FactoredPanelLinear, PanelLinear
g = torch.Generator().manual_seed(0)
for rows in (1, 2, 3, 5, 49):
    for n, k in ((96, 64), (70, 192), (8, 128)):  # 70: a panel's second half in part; 8: none of it
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g) * 3
        want = int8_linear_ref(x, w)
        torch.testing.assert_close(PanelLinear(w, int8=True)(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
a, b = torch.randn(64, 128, generator=g), torch.randn(40, 64, generator=g)
x = torch.randn(5, 128, generator=g)
want = int8_linear_ref(int8_linear_ref(x, a), b)
torch.testing.assert_close(FactoredPanelLinear(a, [64], [b], int8=True)(x), want, rtol=0, atol=1e-5 * want.abs().max().item())
runner = TorchRunner(__import__("pathlib").Path(r"{model}"), 64, "float32", quantization="int8")
runner.load()
reference = TorchRunner(runner.model_dir, 64, "float32", pack_weights=False)
reference.load()
quantize_linears_ref(reference.model, torch.float64)
reference.model.unbind()
chunks = [SeqChunk(slot=0, token_ids=[1, 5, 9, 3, 11], start_pos=0)]
outs = []
for r in (runner, reference):
    r.allocate_kv(1)
    outs.append(r.execute(chunks).float())
torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-4 * outs[1].abs().max().item())
print("ok")
"""


def test_avx2_build_serves_int8_as_the_reference(avx2_ops_env, tiny_model_dir):
    """A CPU with AVX2 but no AVX512-VNNI gets the int8 panels through VPMADDUBSW (x86-64-v3 build, fresh process):
    the reference's outputs at 1-3 rows (one tile of two rows, then two), a ragged last panel, a factored call, and
    the whole tiny model."""
    done = subprocess.run([sys.executable, "-c", _AVX2_INT8.replace("{model}", str(tiny_model_dir))],
                          env=avx2_ops_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
