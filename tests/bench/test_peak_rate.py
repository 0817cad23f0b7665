"""bench.peak_rate: the probe runs each kind this build has, refuses others with a clear error, and each model's GEMMs
are bounded by the instruction they run on."""

from __future__ import annotations

import json

import pytest
import torch

from bench import peak_rate
from server.models import fused_ops

needs_ops = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")

EPYC = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})
XEON_AMX = EPYC | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize("dtype,quantization,flags,kind", [
    ("float32", None, frozenset({"avx2"}), "fp32_fma"),
    ("float32", "gguf", EPYC, "fp32_fma"),        # GGUF blocks decode to fp32: fp32 FMAs
    ("float32", None, XEON_AMX, "fp32_fma"),      # AMX has no fp32 tiles
    ("bfloat16", None, EPYC, "bf16_dot"),
    ("bfloat16", None, XEON_AMX, None),           # AMX tiles: not probed, so no bound is claimed
    ("bfloat16", "int8", EPYC, "int8_dot"),
    ("bfloat16", "int8", frozenset({"avx2", "avx512f"}), None),
])
def test_each_models_gemms_are_bounded_by_the_instruction_they_run_on(dtype, quantization, flags, kind):
    assert peak_rate.gemm_kind(dtype, quantization, flags) == kind


def test_a_bf16_bound_is_the_faster_of_its_dot_product_and_fp32_fmas():
    assert peak_rate.bounding_peak("bf16_dot", {"fp32_fma": 230.0, "bf16_dot": 460.0}) == {"kind": "bf16_dot",
                                                                                          "gops": 460.0}
    assert peak_rate.bounding_peak("bf16_dot", {"fp32_fma": 230.0, "bf16_dot": 150.0})["kind"] == "fp32_fma"
    assert peak_rate.bounding_peak("int8_dot", {"fp32_fma": 230.0}) is None  # not measured: no bound
    assert peak_rate.bounding_peak(None, {"fp32_fma": 230.0}) is None


@needs_ops
def test_every_kind_of_this_build_runs_and_an_fp32_fma_peak_is_there_on_x86():
    kinds = peak_rate.peak_kinds()
    assert "fp32_fma" in kinds  # the machines this suite runs on have AVX2 with FMA at least
    assert all(peak_rate.peak_rate(k, repeats=1) > 0 for k in kinds)
    assert peak_rate.gemm_peak("fp32_fma")["kind"] == "fp32_fma" and peak_rate.gemm_peak(None) is None


@needs_ops
def test_an_unknown_kind_or_no_rounds_is_refused_with_what_the_build_has():
    with pytest.raises(RuntimeError, match="no 'fp64_fma'.*fp32_fma"):
        torch.ops.neuronmm.peak_rate("fp64_fma", 1000)
    with pytest.raises(RuntimeError, match="rounds must be positive"):
        torch.ops.neuronmm.peak_rate("fp32_fma", 0)


@needs_ops
def test_the_cli_saves_a_row_per_kind(tmp_path, capsys):
    out = tmp_path / "peak.json"
    assert peak_rate.main(["--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["kind"] for r in report["rows"]] == peak_rate.peak_kinds()
    assert all(r["gops"] > 0 for r in report["rows"]) and "caps_in_force" in report
    assert "| fp32_fma |" in capsys.readouterr().out
