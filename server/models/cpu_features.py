"""What the CPU can do, read from /proc/cpuinfo, and the serving dtype that follows from it.

torch is imported inside the dtype functions: `neuronmm serve` reads the CPU's facts before it spawns the engine
core, without torch's seconds of import."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# Flags that mean the CPU has native bf16 dot products (a bf16 GEMM is then faster than fp32, not emulated).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def _cpuinfo_value(key: str, cpuinfo: Path) -> str | None:
    """The first CPU's `key` line of /proc/cpuinfo (None where the file or the line does not exist)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU (empty where /proc/cpuinfo does not exist)."""
    return frozenset((_cpuinfo_value("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's model name ("unknown" where /proc/cpuinfo does not say)."""
    return _cpuinfo_value("model name", cpuinfo) or "unknown"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


ARCH_ENV = "NEURONMM_CPU_ARCH"  # the -march the fused ops are built for, where not this CPU's own


def target_arch() -> str:
    """The -march the fused ops are built for: $NEURONMM_CPU_ARCH, else `native` (this CPU)."""
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def target_has_native_bf16() -> bool:
    """Whether that target multiplies bf16 natively (AVX512-BF16 or AMX), so the bf16 kernels are built in.

    For -march=native that is this CPU's flags; for a named target (a fleet image built for x86-64-v3, or
    `bench.cpu_caps avx2`) it is what the compiler enables for it, whatever this CPU has.
    """
    arch = target_arch()
    return has_native_bf16() if arch == "native" else _compiler_enables_bf16(os.environ.get("CXX", "g++"), arch)


@functools.cache
def _compiler_enables_bf16(cxx: str, arch: str) -> bool:
    """Whether `cxx -march=arch` defines AVX512-BF16 or AMX-BF16 (asked once per process: start-up asks twice)."""
    try:
        macros = subprocess.run([cxx, f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False  # no compiler: the fused ops will not build either, and the reference path is fp32's
    return "__AVX512BF16__" in macros or "__AMX_BF16__" in macros


def resolve_dtype(name: str, device: torch.device, flags: frozenset[str] | None = None, log_choice: bool = True,
                  target_bf16: bool | None = None) -> torch.dtype:
    """The torch dtype for a config's `model.dtype`; `auto` picks the fastest one that keeps quality.

    auto: on CPU bf16 where the CPU has native bf16 dot products and the fused ops are built for a target that
    uses them (`target_bf16`; default: target_has_native_bf16()), else fp32 (emulated bf16 is slower than fp32);
    on CUDA bf16 where supported, else fp16.
    """
    import torch

    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if device.type == "cuda":
        chosen = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        reason = "CUDA device"
    elif not has_native_bf16(flags):
        chosen, reason = torch.float32, "CPU lacks AVX512-BF16/AMX, bf16 would be emulated"
    elif not (target_has_native_bf16() if target_bf16 is None else target_bf16):
        chosen, reason = torch.float32, "the fused ops' -march lacks AVX512-BF16/AMX, bf16 would be emulated"
    else:
        chosen, reason = torch.bfloat16, "CPU has native bf16 dot products"
    if log_choice:
        log.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), reason)
    return chosen


def activation_dtype(weight_dtype: torch.dtype, device: torch.device, log_choice: bool = True) -> torch.dtype:
    """The dtype a model with `weight_dtype` weights computes in: its own, but fp32 for bf16 weights on a CPU whose
    fused ops have no native bf16 (bf16 activations would be emulated there; the fp32 panel GEMM widens the bf16
    weights exactly, so a step streams half the bytes of fp32 weights at fp32's arithmetic)."""
    import torch

    if device.type != "cpu" or weight_dtype != torch.bfloat16 or target_has_native_bf16():
        return weight_dtype
    if log_choice:
        log.info("bf16 weights with fp32 activations: this CPU (or the fused ops' -march) has no native bf16 "
                 "dot products")
    return torch.float32
