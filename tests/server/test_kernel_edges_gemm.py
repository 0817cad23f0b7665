"""Edges of the panel GEMMs (csrc/small_gemm.cpp, csrc/int8_gemm.cpp) the main tests leave out: every row count
from 1 to 40 and around a work item's 48 rows (register tiles of 12, 6, 3 and 32 rows, each with its tails), N and K
tails on one call, and factored calls of three parts with splits off the 32-column panels, each kind against float64
products of the operands it multiplies."""

import pytest
import torch

from server.models import fused_ops, gemm_tuning
from server.models.gguf_blocks import decode_blocks, pack_block_panels
from server.models.int8_linear import dequantize_rows_ref, dequantize_weight, int8_available, pack_int8_panels

pytestmark = pytest.mark.skipif(not (fused_ops.load() and hasattr(torch.ops.neuronmm, "panel_linear_f32")),
                                reason="the panel GEMMs are not built here")
ops = torch.ops.neuronmm if fused_ops.load() else None
ROWS = [*range(1, 41), 47, 48, 49, 97]
# The row sweeps run on one thread: the tiles and their tails are each thread's own (the splits between threads are
# the factored test's), and a parallel region a call costs ms where other jobs hold the cores.
BF16 = fused_ops.load() and hasattr(torch.ops.neuronmm, "panel_linear")
INT8 = fused_ops.load() and int8_available()


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, label) -> None:
    """got = x · wᵀ up to fp32 sums (1e-5 of the sum of |products|: K <= 130 roundings of 2^-24 each, with room) and,
    for a bf16 output, its one rounding (2^-8 of the value)."""
    want, size = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    limit = 1e-5 * size + (2 ** -8 * want.abs() if got.dtype == torch.bfloat16 else 0)
    excess = (got.double() - want).abs() - limit
    assert got.shape == want.shape and not got.isnan().any() and (excess <= 0).all(), (label, excess.max().item())


@pytest.fixture
def bf16_path():
    """Sends every bf16 GEMM down one path for a test ("dot": VDPBF16PS, "fma", "amx"); restores the tuned ones."""
    if not BF16:
        yield lambda path: None
        return
    before = gemm_tuning.bf16_kernels() or gemm_tuning.Bf16Kernels(0, 0)

    def use(path: str) -> None:
        ops.set_bf16_fma_rows(1 if path == "fma" else 0)
        ops.set_bf16_amx_rows(1 if path == "amx" else 0)

    yield use
    use("dot")
    ops.set_bf16_fma_rows(before.fma_rows)
    ops.set_bf16_amx_rows(before.amx_rows)


def test_fp32_bf16_weight_and_gguf_panels_at_every_row_count():
    """fp32 panels at K = 33 (no whole 16 / 32 inputs) and N = 65 (a panel of one column); bf16 weights in them; GGUF
    block panels, whose sums are the fp32 panels' of the decoded weights bit for bit."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(65, 33, generator=g)
    codes = torch.randint(-128, 128, (33, 64), generator=g, dtype=torch.int8)
    d = (torch.rand(33, 2, generator=g) / 64).half().float()  # an f16 scale: d·q exact, as in a GGUF
    m = (torch.randn(33, 2, generator=g) / 64).half().float()
    decoded = decode_blocks(codes, d, m)
    fp32, narrow = ops.pack_panels_f32(w), ops.pack_panels_f32(w.bfloat16())
    blocks, dense = pack_block_panels(codes, d, m), ops.pack_panels_f32(decoded)
    for rows in ROWS:
        x, xk = torch.randn(rows, 33, generator=g), torch.randn(rows, 64, generator=g)
        _assert_close(ops.panel_linear_f32(x, fp32, 65), x, w, ("fp32", rows))
        _assert_close(ops.panel_linear_f32(x, narrow, 65), x, w.bfloat16().float(), ("bf16 weights", rows))
        got = ops.panel_linear_f32(xk, blocks, 33)
        assert torch.equal(got, ops.panel_linear_f32(xk, dense, 33)), rows
        _assert_close(got, xk, decoded, ("gguf", rows))


@pytest.mark.skipif(not BF16, reason="the bf16 panel GEMM needs AVX512-BF16")
@pytest.mark.parametrize("path", ["dot", "fma", "amx"])
def test_bf16_panels_at_every_row_count_on_each_path(bf16_path, path):
    """K = 96 (whole AMX tile steps) and 66 (none: the AMX setting falls back to the vector path), N = 33."""
    if path == "amx" and not gemm_tuning.amx_available():
        pytest.skip("no AMX here")
    bf16_path(path)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    for K in (96, 66):
        w = torch.randn(33, K, generator=g).bfloat16()
        panels = ops.pack_panels(w)
        for rows in ROWS:
            x = torch.randn(rows, K, generator=g).bfloat16()
            _assert_close(ops.panel_linear(x, panels, 33), x, w, (path, K, rows))


@pytest.mark.skipif(not INT8, reason="the int8 panel GEMM needs AVX512-VNNI or AVX2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_panels_at_every_row_count(dtype):
    """Tiles of 6 rows (2 on AVX2) and work items of 48, N = 33: the product of the operands as quantised (the block
    sums are exact integers, then scaled in fp32)."""
    if dtype == torch.bfloat16 and not BF16:
        pytest.skip("bf16 activations need AVX512-BF16")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 128, generator=g)
    panels = pack_int8_panels(w)
    for rows in ROWS:
        x = torch.randn(rows, 128, generator=g).to(dtype)
        got = ops.panel_linear_int8(x, panels, 33)
        assert got.dtype == dtype
        _assert_close(got, dequantize_rows_ref(x), dequantize_weight(w), ("int8", dtype, rows))


def _factored_kinds():
    kinds = [("fp32", None)]
    if BF16:
        kinds += [("bf16", "dot"), ("bf16", "fma")] + ([("bf16", "amx")] if gemm_tuning.amx_available() else [])
    return kinds + ([("int8", None)] if INT8 else [])


@pytest.mark.parametrize("kind,path", _factored_kinds())
@pytest.mark.parametrize("rows", [1, 13, 49])
def test_three_part_factored_calls_with_splits_off_the_panels(bf16_path, kind, path, rows):
    """Three parts whose splits do not start on 32-column panels (t written whole, the pass-through part copied out)
    or do (int8: splits of 64), a part with a one-column second GEMM: each part's output is its second GEMM of its
    slice of t, t as one GEMM gives it."""
    if path is not None:
        bf16_path(path)
    g = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    K, splits, outs = (128, [64, 128, 64], [1, 128, 40]) if kind == "int8" else (96, [34, 20, 46], [1, 20, 40])
    pack = {"fp32": ops.pack_panels_f32, "int8": pack_int8_panels, "bf16": ops.pack_panels if BF16 else None}[kind]
    x = torch.randn(rows, K, generator=g).to(dtype)
    first = (torch.randn(sum(splits), K, generator=g) / K ** 0.5).to(dtype)
    seconds = [(torch.randn(outs[0], splits[0], generator=g) / 8).to(dtype), None,
               (torch.randn(outs[2], splits[2], generator=g) / 8).to(dtype)]
    got = ops.factored_linear(x, pack(first), splits, [None if b is None else pack(b) for b in seconds], outs)
    t = ops.factored_linear(x, pack(first), [sum(splits)], [None], [sum(splits)])
    quantised = dequantize_rows_ref if kind == "int8" else (lambda a: a)
    weight = dequantize_weight if kind == "int8" else (lambda b: b)
    _assert_close(t, quantised(x), weight(first), (kind, "t"))
    col = out_col = 0
    for split, b, out in zip(splits, seconds, outs):
        part, ts = got[:, out_col:out_col + out], t[:, col:col + split].contiguous()
        if b is None:
            assert torch.equal(part, ts)
        else:
            _assert_close(part, quantised(ts), weight(b), (kind, path, col))
        col, out_col = col + split, out_col + out
