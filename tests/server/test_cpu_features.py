"""`dtype: auto`: bf16 only where the CPU and the fused ops' build target both multiply it natively, else fp32."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from server.models import cpu_features
from server.models.cpu_features import has_native_bf16, resolve_dtype

CPU = torch.device("cpu")
AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="asks the system compiler about a -march")


@pytest.mark.parametrize("flags, target_bf16, expected", [
    (AVX2, True, torch.float32),              # no native bf16 on the CPU: fp32 whatever the build
    (AVX512_BF16, True, torch.bfloat16),
    (AVX2 | {"amx_bf16"}, True, torch.bfloat16),
    (AVX512_BF16, False, torch.float32),      # the CPU has it, the fused ops are built without it
])
def test_auto_picks_bf16_only_where_cpu_and_build_both_have_it(flags, target_bf16, expected):
    assert has_native_bf16(flags) == (flags != AVX2)
    assert resolve_dtype("auto", CPU, flags, log_choice=False, target_bf16=target_bf16) == expected


def test_an_explicit_dtype_is_taken_as_it_is():
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert resolve_dtype(name, CPU, AVX2, target_bf16=False) == dtype


def test_the_choice_and_its_reason_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="server.models.cpu_features"):
        resolve_dtype("auto", CPU, AVX512_BF16, target_bf16=False)
        resolve_dtype("auto", CPU, AVX512_BF16, target_bf16=True)
    assert [r.getMessage() for r in caplog.records] == [
        "dtype auto -> float32 (the fused ops' -march lacks AVX512-BF16/AMX, bf16 would be emulated)",
        "dtype auto -> bfloat16 (CPU has native bf16 dot products)"]


@needs_compiler
@pytest.mark.parametrize("arch, expected", [("x86-64-v3", False), ("x86-64-v4", False), ("sapphirerapids", True),
                                            ("cooperlake", True)])
def test_a_named_target_is_judged_by_what_the_compiler_enables_for_it(monkeypatch, arch, expected):
    monkeypatch.setenv(cpu_features.ARCH_ENV, arch)
    assert cpu_features.target_arch() == arch
    assert cpu_features.target_has_native_bf16() is expected
    flags_seen = []
    monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: flags_seen.append(1) or True)
    cpu_features.target_has_native_bf16()
    assert not flags_seen  # a named target never falls back to this CPU's flags


def test_the_native_target_is_this_cpus_flags(monkeypatch):
    monkeypatch.delenv(cpu_features.ARCH_ENV, raising=False)
    assert cpu_features.target_arch() == "native"
    for cpu_has_it in (True, False):
        monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: cpu_has_it)
        assert cpu_features.target_has_native_bf16() is cpu_has_it


@pytest.mark.parametrize("weights,device,target_bf16,expected", [
    (torch.bfloat16, "cpu", False, torch.float32),   # bf16 weights widened into fp32 arithmetic
    (torch.bfloat16, "cpu", True, torch.bfloat16),   # native bf16: the model computes in bf16
    (torch.float32, "cpu", False, torch.float32),
    (torch.bfloat16, "cuda", False, torch.bfloat16),
])
def test_bf16_weights_compute_in_fp32_only_where_bf16_would_be_emulated(monkeypatch, caplog, weights, device,
                                                                        target_bf16, expected):
    monkeypatch.setattr(cpu_features, "target_has_native_bf16", lambda: target_bf16)
    with caplog.at_level(logging.INFO, logger="server.models.cpu_features"):
        assert cpu_features.activation_dtype(weights, torch.device(device)) == expected
    assert ("fp32 activations" in caplog.text) == (expected != weights)
