"""Which instructions the panel GEMMs multiply with on this CPU: chosen once a process by timing them.

csrc/small_gemm.cpp multiplies bf16 panels with VDPBF16PS (two products per lane and instruction), with fp32
FMAs after widening them in registers, or, where the CPU has AMX, with tile products (TDPBF16PS). At one or two
rows of x every path streams the weight at memory bandwidth; with more rows the vector paths are compute-bound
and which one is faster depends on the core: on the Emerald Rapids Xeons we measured the FMA path runs ~1.6 x
faster than VDPBF16PS from 4 rows, and on a Xeon with AMX the tiles run 5-6 x faster than either from 16 rows
(docs/BENCHMARKS.md). Rather than guess from the CPU model, `tune_bf16_kernels` times each on a decode-sized
weight at the first start on a machine (~50 ms; the paths in turns, each by its fastest rep, so that a busy
neighbour cannot pick for it) and sets the row counts from which the FMA and the AMX paths are used. The choice is
kept beside the fused ops' build for this CPU (`bf16_kernels.json`) and read by every later start: each path sums a
row's products in its own order, so a start that timed its way to other thresholds could answer a greedy request
with other tokens at a near-tie. Delete the file to time again.
`NEURONMM_BF16_FMA_ROWS` and `NEURONMM_BF16_AMX_ROWS` fix them instead (0: never), for A/B runs.

torch is imported inside the functions that time or set the kernels: `neuronmm serve` checks the two variables
before it spawns the engine core, without torch's seconds of import.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from server.errors import ConfigError
from server.fileio import write_json_atomic
from server.models.cpu_features import cpu_model

log = logging.getLogger(__name__)

CANDIDATE_ROWS = (2, 4, 8, 16)
MIN_GAIN = 0.95  # a path must take under 95 % of the time of the one it replaces to be chosen at a row count
FMA_ENV = "NEURONMM_BF16_FMA_ROWS"
AMX_ENV = "NEURONMM_BF16_AMX_ROWS"
CHOICE_FILE = "bf16_kernels.json"


@dataclass(frozen=True)
class Bf16Kernels:
    """From how many rows of x the bf16 panel GEMMs use fp32 FMAs and AMX tiles (0: never); VDPBF16PS below."""

    fma_rows: int
    amx_rows: int

    def describe(self) -> str:
        """One line for the start-up log."""
        parts = [f"AMX tiles from {self.amx_rows} rows"] if self.amx_rows else []
        if self.fma_rows and (not self.amx_rows or self.fma_rows < self.amx_rows):
            parts.append(f"fp32 FMAs from {self.fma_rows} rows")
        return ", ".join(parts + ["VDPBF16PS below"]) if parts else "VDPBF16PS at every row count"


_chosen: Bf16Kernels | None = None


def _fastest_us(paths: dict[str, Callable[[], None]], call: Callable[[], None], reps: int = 30,
                warmup: int = 5) -> dict[str, float]:
    """`call`'s fastest time in µs over `reps` under each path (each path's function, run untimed before the call,
    selects it), the paths taking turns rep by rep. Another process busy on these cores (a second server starting
    up, a neighbour) only ever adds time, and in turns it adds it to whichever path it lands on: the median of one
    path's reps timed back to back, then the next path's, once put AMX behind VDPBF16PS at 16 rows and left a server
    stepping at 31 ms where 19 was its speed."""
    for use in paths.values():
        use()
        for _ in range(warmup):
            call()
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(reps):
        for name, use in paths.items():
            use()
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: 1e6 * t for name, t in best.items()}


def threshold_from(timings: dict[int, tuple[float, float]]) -> int:
    """The smallest row count from which a new path wins at it and every larger one (0: none); timings map a row
    count to its (current µs, new µs). A win must clear MIN_GAIN, so noise between equals keeps the current path."""
    chosen = 0
    for rows in sorted(timings, reverse=True):
        current_us, new_us = timings[rows]
        if new_us >= MIN_GAIN * current_us:
            break
        chosen = rows
    return chosen


def amx_available() -> bool:
    """Whether this build of the panel GEMMs has AMX and the kernel lets this process use it."""
    import torch

    return bool(torch.ops.neuronmm.bf16_amx_available())


def _time_paths(paths: dict[str, Callable[[], None]]) -> dict[str, dict[int, float]]:
    """µs of a decode-sized bf16 panel GEMM (a small model's 1536 x 576 MLP matrix) per path and candidate row
    count; each path is the call that makes every row count take it."""
    import torch

    op = torch.ops.neuronmm
    gen = torch.Generator().manual_seed(0)
    panels = op.pack_panels(torch.randn(1536, 576, generator=gen).bfloat16())
    timings: dict[str, dict[int, float]] = {path: {} for path in paths}
    with torch.inference_mode():
        for rows in CANDIDATE_ROWS:
            x = torch.randn(rows, 576, generator=gen).bfloat16()
            for path, us in _fastest_us(paths, lambda: op.panel_linear(x, panels, 1536)).items():
                timings[path][rows] = us
    return timings


def _timings(amx: bool) -> dict[str, dict[int, float]]:
    """µs per bf16 path (dot, fma and, where usable, amx) and candidate row count."""
    import torch

    op = torch.ops.neuronmm

    def use(fma_from: int, amx_from: int) -> Callable[[], None]:
        return lambda: (op.set_bf16_fma_rows(fma_from), op.set_bf16_amx_rows(amx_from))

    paths = {"dot": use(0, 0), "fma": use(1, 0)} | ({"amx": use(0, 1)} if amx else {})
    return _time_paths(paths)


def kernels_from(timings: dict[str, dict[int, float]]) -> Bf16Kernels:
    """The thresholds the timings call for: FMA against VDPBF16PS, then AMX against whichever of those runs."""
    dot, fma = timings["dot"], timings["fma"]
    fma_rows = threshold_from({r: (dot[r], fma[r]) for r in dot})
    if "amx" not in timings:
        return Bf16Kernels(fma_rows, 0)
    vector = {r: fma[r] if fma_rows and r >= fma_rows else dot[r] for r in dot}
    return Bf16Kernels(fma_rows, threshold_from({r: (vector[r], timings["amx"][r]) for r in dot}))


def read_choice(path: Path, amx: bool) -> Bf16Kernels | None:
    """The thresholds an earlier start on this CPU timed (None: no file, another CPU model or AMX state, or a file
    that does not read as one)."""
    try:
        saved = json.loads(path.read_text())
        rows = (saved["fma_rows"], saved["amx_rows"])
        if saved["cpu"] != cpu_model() or saved["amx"] != amx or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rows):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Bf16Kernels(*rows)


def save_choice(path: Path, kernels: Bf16Kernels, amx: bool, timings: dict[str, dict[int, float]]) -> None:
    """Keep the timed thresholds for later starts on this CPU; a folder that cannot take it only costs a new timing."""
    try:
        timed_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_json_atomic(path, {"fma_rows": kernels.fma_rows, "amx_rows": kernels.amx_rows, "amx": amx,
                                 "cpu": cpu_model(), "timed_at": timed_at, "us_by_rows": timings})
    except OSError as exc:
        log.warning("could not keep the bf16 kernel choice in %s: %s", path, exc)


def rows_from_env(name: str) -> int | None:
    """The threshold the variable `name` fixes (None when unset); ConfigError for anything but a count >= 0."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{name} must be a row count >= 0 (0: never use that path), got {value!r}")
    return int(value)


def check_env() -> None:
    """ConfigError for a bad NEURONMM_BF16_FMA_ROWS / NEURONMM_BF16_AMX_ROWS (`serve` checks them early)."""
    for name in (FMA_ENV, AMX_ENV):
        rows_from_env(name)


def tune_bf16_kernels(choice_file: Path | None = None) -> Bf16Kernels:
    """Set (once a process) and return the row counts from which bf16 panel GEMMs use fp32 FMAs and AMX: what
    `choice_file` (CHOICE_FILE beside the fused ops' build, for the server) kept from an earlier start, else timed
    now and kept there (without a file: timed each process)."""
    global _chosen
    if _chosen is not None:
        return _chosen
    import torch

    op = torch.ops.neuronmm
    fixed_fma, fixed_amx = rows_from_env(FMA_ENV), rows_from_env(AMX_ENV)
    amx = amx_available()
    if fixed_amx and not amx:
        raise ConfigError(f"{AMX_ENV}={fixed_amx}, but this CPU (or this build) has no usable AMX")
    detail = f"{FMA_ENV}/{AMX_ENV}"
    if fixed_fma is None or (fixed_amx is None and amx):
        tuned = read_choice(choice_file, amx) if choice_file is not None else None
        if tuned is not None:
            detail = f"timed at an earlier start on this CPU: {choice_file}; delete it to time again"
        else:
            timings = _timings(amx)
            tuned = kernels_from(timings)
            if choice_file is not None:
                save_choice(choice_file, tuned, amx, timings)
            detail = "µs on 1536x576 by rows, " + "; ".join(
                f"{mode} " + "/".join(f"{us:.0f}" for us in by_rows.values()) for mode, by_rows in timings.items())
            detail += " at " + "/".join(map(str, CANDIDATE_ROWS))
        fixed_fma = tuned.fma_rows if fixed_fma is None else fixed_fma
        fixed_amx = tuned.amx_rows if fixed_amx is None else fixed_amx
    _chosen = Bf16Kernels(fixed_fma, fixed_amx or 0)
    op.set_bf16_fma_rows(_chosen.fma_rows)
    op.set_bf16_amx_rows(_chosen.amx_rows)
    log.info("bf16 panel GEMM: %s (%s)", _chosen.describe(), detail)
    return _chosen


def bf16_kernels() -> Bf16Kernels | None:
    """The thresholds tune_bf16_kernels set in this process (None before it ran)."""
    return _chosen
