"""Where an engine step's time goes, part by part: a clock around each of the engine's parts while a level runs.

The parts: the whole `LLMEngine.step`; the runner's `execute` (batch, forward, logits); inside it the C++ layer loop
(`decode_layers`, where the model runs one) and the LM head; around it the scheduler and the sampler. What the
clocks leave between them is the step's Python and glue: the rest of the forward (the batch's tensors, the embedding,
the rotary tables, the op calls) and the engine around `execute` (sampling's bookkeeping, detokenising, the outputs).
On 2 cores that time is serial: the other OpenMP thread waits through it. Each clock is one `perf_counter_ns` pair
around a Python call (~0.2 µs); `bench.engine_workload --step-parts` prints the medians per level.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from server.engine import llm_engine

PARTS = ("step", "execute", "layers", "lm_head", "schedule", "sample")


def _clocked(call: Callable, times: list[int]) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return call(*args, **kwargs)
        finally:
            times.append(time.perf_counter_ns() - start)
    return timed


@contextmanager
def part_clocks(engine) -> Iterator[dict[str, list[int]]]:
    """Clocks on the engine's parts while the block runs (nanoseconds per call, by part name); put back after."""
    times: dict[str, list[int]] = defaultdict(list)
    runner, undo = engine.runner, []

    def clock(owner, name: str, part: str) -> None:
        original = owner.__dict__.get(name)  # an instance attribute to put back, or None (the class's method)
        setattr(owner, name, _clocked(getattr(owner, name), times[part]))
        undo.append(lambda: setattr(owner, name, original) if original is not None else delattr(owner, name))

    clock(engine, "step", "step")
    clock(runner, "execute", "execute")
    clock(engine.scheduler, "schedule", "schedule")
    model = getattr(runner, "model", None)
    if model is not None and getattr(model, "lm_head", None) is not None:
        clock(model.lm_head, "forward", "lm_head")
    kernels = getattr(model, "kernels", None)
    if kernels is not None and getattr(kernels, "decode_layers", None) is not None:
        model.kernels = dataclasses.replace(kernels, decode_layers=_clocked(kernels.decode_layers, times["layers"]))
        undo.append(lambda: setattr(model, "kernels", kernels))
    sample = llm_engine.sample
    llm_engine.sample = _clocked(sample, times["sample"])
    undo.append(lambda: setattr(llm_engine, "sample", sample))
    try:
        yield times
    finally:
        for put_back in reversed(undo):
            put_back()


def medians_ms(times: dict[str, list[int]]) -> dict[str, float | None]:
    """Each part's median call in ms (None for a part that never ran), and the step's Python and glue: the rest of
    the forward (execute less the layers and the LM head) and the engine around execute (step less execute)."""
    med = {part: (statistics.median(times[part]) / 1e6 if times.get(part) else None) for part in PARTS}
    step, execute = med["step"], med["execute"]
    inside = (med["layers"] or 0.0) + (med["lm_head"] or 0.0)
    med["rest_of_forward"] = execute - inside if execute is not None and med["layers"] is not None else None
    med["around_execute"] = step - execute if step is not None and execute is not None else None
    glue = [v for v in (med["rest_of_forward"], med["around_execute"]) if v is not None]
    med["glue_share"] = sum(glue) / step if step and med["rest_of_forward"] is not None else None
    return med


def table(rows: list[dict]) -> str:
    """Markdown: one row per level with its parts' medians (rows: each with `concurrency` and `step_parts_ms`)."""
    cell = lambda v, fmt="{:.2f}": "–" if v is None else fmt.format(v)  # noqa: E731
    percent = lambda share: None if share is None else 100 * share  # noqa: E731
    lines = ["| c | step ms | layers (C++) | LM head | rest of the forward | engine around execute | schedule | sample "
             "| Python and glue, of the step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["step_parts_ms"]
        lines.append(f"| {r['concurrency']} | {cell(m['step'])} | {cell(m['layers'])} | {cell(m['lm_head'])} | "
                     f"{cell(m['rest_of_forward'])} | {cell(m['around_execute'])} | {cell(m['schedule'], '{:.3f}')} | "
                     f"{cell(m['sample'], '{:.3f}')} | {cell(percent(m['glue_share']), '{:.1f} %')} |")
    return "\n".join(lines)
