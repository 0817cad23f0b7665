"""Which instruction the bf16 panel GEMMs multiply with on this CPU: chosen once a process by timing both.

csrc/small_gemm.cpp multiplies bf16 panels either with VDPBF16PS (two products per lane and instruction) or,
widening them in registers, with fp32 FMAs. At one or two rows of x both stream the weight at memory bandwidth;
with more rows the GEMM is compute-bound and which one is faster depends on the core: on the Emerald Rapids
Xeons we measured, the FMA path runs ~1.6 x faster from 4 rows (docs/BENCHMARKS.md). Rather than guess from the
CPU model, `tune_bf16_fma_rows` times both on a decode-sized weight at start-up (~30 ms) and sets the row count
from which the FMA path is used. `NEURONMM_BF16_FMA_ROWS` fixes it instead (0: never), for A/B runs.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (2, 4, 8, 16)
MIN_GAIN = 0.95  # the FMA path must take under 95 % of the dot path's time to be chosen at a row count
_ENV = "NEURONMM_BF16_FMA_ROWS"
_chosen: int | None = None


def _median_us(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def threshold_from(timings: dict[int, tuple[float, float]]) -> int:
    """The smallest row count from which the FMA path wins at every larger one (0: none); timings map a row
    count to its (dot µs, FMA µs). A win must clear MIN_GAIN, so noise between equals keeps the dot path."""
    chosen = 0
    for rows in sorted(timings, reverse=True):
        dot_us, fma_us = timings[rows]
        if fma_us >= MIN_GAIN * dot_us:
            break
        chosen = rows
    return chosen


def _timings() -> dict[int, tuple[float, float]]:
    """(dot µs, FMA µs) of each candidate row count on a decode-sized weight."""
    op = torch.ops.neuronmm
    gen = torch.Generator().manual_seed(0)
    panels = op.pack_panels(torch.randn(1536, 576, generator=gen).to(torch.bfloat16))  # a small model's MLP shape
    timings = {}
    for rows in CANDIDATE_ROWS:
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        per_mode = []
        for fma_from in (0, rows):  # 0: the dot path at this row count; rows: the FMA path
            op.set_bf16_fma_rows(fma_from)
            per_mode.append(_median_us(lambda: op.panel_linear(x, panels, 1536)))
        timings[rows] = (per_mode[0], per_mode[1])
    return timings


def fma_rows_from_env() -> int | None:
    """The threshold NEURONMM_BF16_FMA_ROWS fixes (None when unset); ValueError for anything but a count >= 0."""
    value = os.environ.get(_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{_ENV} must be a row count >= 0 (0: never use the FMA path), got {value!r}")
    return int(value)


def _describe(fma_from: int) -> str:
    return f"fp32 FMAs from {fma_from} rows, VDPBF16PS below" if fma_from else "VDPBF16PS at every row count"


def tune_bf16_fma_rows() -> int:
    """Set (once a process) and return the row count from which bf16 panel GEMMs use fp32 FMAs (0: never)."""
    global _chosen
    if _chosen is not None:
        return _chosen
    op = torch.ops.neuronmm
    fixed = fma_rows_from_env()
    if fixed is not None:
        _chosen = fixed
        op.set_bf16_fma_rows(_chosen)
        log.info("bf16 panel GEMM: %s (%s)", _describe(_chosen), _ENV)
        return _chosen
    with torch.inference_mode():
        timings = _timings()
    _chosen = threshold_from(timings)
    op.set_bf16_fma_rows(_chosen)
    detail = ", ".join(f"{r} rows {d:.0f}/{f:.0f} µs" for r, (d, f) in timings.items())
    log.info("bf16 panel GEMM: %s (VDPBF16PS/FMA on 1536x576: %s)", _describe(_chosen), detail)
    return _chosen


def bf16_fma_rows() -> int | None:
    """The row count tune_bf16_fma_rows set in this process (None before it ran)."""
    return _chosen
