"""What the CPU can do, read from /proc/cpuinfo, and the serving dtype that follows from it."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Flags that mean the CPU has native bf16 dot products (a bf16 GEMM is then faster than fp32, not emulated).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU (empty where /proc/cpuinfo does not exist)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool((cpu_flags() if flags is None else flags) & NATIVE_BF16_FLAGS)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device, flags: frozenset[str] | None = None, log_choice: bool = True,
                  target_bf16: bool | None = None) -> torch.dtype:
    """The torch dtype for a config's `model.dtype`; `auto` picks the fastest one that keeps quality.

    auto: on CPU bf16 where the CPU has native bf16 dot products and the fused ops are built for a target that
    uses them (`target_bf16`; default: ask fused_ops), else fp32 (emulated bf16 is slower than fp32); on CUDA
    bf16 where supported, else fp16.
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        chosen = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        reason = "CUDA device"
    elif not has_native_bf16(flags):
        chosen, reason = torch.float32, "CPU lacks AVX512-BF16/AMX, bf16 would be emulated"
    elif not (_target_has_native_bf16() if target_bf16 is None else target_bf16):
        chosen, reason = torch.float32, "the fused ops' -march lacks AVX512-BF16/AMX, bf16 would be emulated"
    else:
        chosen, reason = torch.bfloat16, "CPU has native bf16 dot products"
    if log_choice:
        log.info("dtype auto -> %s (%s)", str(chosen).removeprefix("torch."), reason)
    return chosen


def _target_has_native_bf16() -> bool:
    from server.models import fused_ops  # it reads this module's flags: imported here, not at the top

    return fused_ops.target_has_native_bf16()
