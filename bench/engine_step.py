"""Decode step time of the torch backend in-process (no HTTP, no client): the engine's own ceiling.

Fills `batch` sequences of the paged KV cache (the config's block size, as served) with a 128-token
random prompt each, then times single-token decode steps for all of them together (model forward +
logits, no sampling). Compare with `bench.serve`, whose
TPOT adds the sampler, detokenisation, SSE and a client sharing the same cores. Each row also states the step's
FLOPs (bench.model_costs) and its compute floor, those FLOPs at the peak of the instruction its GEMMs run on,
measured after the steps (bench.peak_rate).

    python -m bench.engine_step --batch-sizes 1 4 16 32

With `--compressed DIR --ab-rounds N`, the dense model and the artifact are loaded side by side in one process
and timed in N alternating rounds (ABBA order) per batch size, so the speed-up is a ratio of neighbouring rounds:
a noisy or drifting shared CPU moves both sides of each ratio together.

    python -m bench.engine_step --batch-sizes 1 16 --steps 40 --compressed DIR --ab-rounds 8
    python -m bench.engine_step --batch-sizes 1 16 --steps 60 --compressed DIR --ab-rounds 8 --ab-paired

`--ab-paired` alternates the two models step by step within each round (ABBA by step) and takes the median of the
per-step ratios: on the 2-vCPU VMs measured, rounds of runs moved ±5 % apart where paired rounds moved ±1.5 %.
Each round records the core-to-core round trip before it (bench.core_latency): a VM's host moves its vCPUs between
placements that share an L3 or not, and the speed-up differs between them (docs/BENCHMARKS.md).

`--region-times` adds, per batch size, where the GEMM and attention regions lose time to their threads (fork, tail,
join, and in a low-rank call's two-phase region the threads' skew at its barrier) and how much of a step runs outside
them (the Python of the step, the small ops).

    python -m bench.engine_step --batch-sizes 1 16 --region-times

`--hold SECONDS` then keeps stepping the last batch size for that long at a fixed context (positions cycling over the
next 64), printing the process id first, so a sampling profiler sees steady steps (`perf record -p PID`, py-spy):

    python -m bench.engine_step --batch-sizes 16 --context 192 --hold 30 & sleep 15; perf record -p <PID> -- sleep 6
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.core_latency import core_round_trip_ns
from bench.harness import (KV_CACHE_DTYPES, check_out, machine_facts, nonnegative_float, nonnegative_int,
                           positive_int, run_cli)
from bench.model_costs import TokenArithmetic, weight_bytes
from bench.peak_rate import gemm_peak, runner_gemm_kind
from server.backends import gguf_source
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.config import load_config
from server.errors import ConfigError
from server.fileio import write_json_atomic
from server.gc_heap import startup_heap
from server.models import fused_ops
from server.models.gemm_tuning import bf16_kernels
from server.models.source import check_max_model_len, model_positions, resolve_model_dir

RESULTS = Path(__file__).parent / "results"


def _filled(runner, batch_size: int, context: int, steps: int, seed: int, block_size: int, first_slot: int = 0,
            loras: list[str | None] | None = None):
    """`batch_size` sequences of a `context`-token random prompt each in the paged cache, as the server runs it
    (sequence s, from `first_slot` on, owns blocks s*per_seq .. (s+1)*per_seq - 1; the i-th runs through LoRA adapter
    loras[i] where given); returns step(i), which times decode step i of all of them, and release()."""
    rng = random.Random(seed)
    per_seq = -(-(context + steps) // block_size)
    slots = range(first_slot, first_slot + batch_size)
    tables = {s: list(range(s * per_seq, (s + 1) * per_seq)) for s in slots}
    adapters = dict(zip(slots, loras or [None] * batch_size))
    for slot in slots:
        prompt = [rng.randrange(1000, runner.vocab_size) for _ in range(context)]
        runner.execute([SeqChunk(slot=slot, token_ids=prompt, start_pos=0, block_table=tables[slot],
                                 lora=adapters[slot])])

    def step(i: int) -> float:
        chunks = [SeqChunk(slot=s, token_ids=[rng.randrange(1000, runner.vocab_size)], start_pos=context + i,
                           block_table=tables[s], lora=adapters[s]) for s in slots]
        start = time.perf_counter()
        runner.execute(chunks)
        return time.perf_counter() - start

    def release() -> None:
        for slot in slots:
            runner.release_slot(slot)

    return step, release


def step_times(runner, batch_size: int, context: int, steps: int, seed: int, block_size: int) -> list[float]:
    """Seconds per decode step for `batch_size` sequences that each hold `context` tokens."""
    step, release = _filled(runner, batch_size, context, steps, seed, block_size)
    times = [step(i) for i in range(steps)]
    release()
    return times


def region_times(runner, batch_size: int, context: int, steps: int, seed: int, block_size: int) -> dict:
    """Per decode step (after 5 untimed ones), where the balanced parallel regions' wall time goes beyond their
    threads' work (csrc/work_split.h RegionTimes: fork, tail, join, barrier), their wall time, and the step's time
    outside them; the region clocks run only over these steps, not over the timed ones."""
    step, release = _filled(runner, batch_size, context, steps, seed, block_size)
    for i in range(5):
        step(i)
    torch.ops.neuronmm.region_times(True)
    try:
        total = sum(step(i) for i in range(5, steps))
    finally:
        regions, fork, tail, join, wall, barrier = torch.ops.neuronmm.region_times(False)
        release()
    n = steps - 5
    per_step = {"regions": regions / n, "fork_ms": fork / n / 1e6, "tail_ms": tail / n / 1e6,
                "join_ms": join / n / 1e6, "barrier_ms": barrier / n / 1e6, "in_regions_ms": wall / n / 1e6,
                "step_ms": 1000 * total / n}
    per_step["outside_regions_ms"] = per_step["step_ms"] - per_step["in_regions_ms"]
    return per_step


HOLD_CYCLE = 64  # positions a held run's steps cycle over past its context


def held_step_times(runner, batch_size: int, context: int, seconds: float, seed: int, block_size: int,
                    clock=time.monotonic) -> list[float]:
    """Seconds per decode step of `batch_size` sequences, stepping for `seconds` at positions context .. context +
    HOLD_CYCLE - 1 in turn (from the second round on, a step writes its K/V over what an earlier round wrote there),
    so a long profile sees steps of about one context length rather than ones that grow."""
    step, release = _filled(runner, batch_size, context, HOLD_CYCLE, seed, block_size)
    times, end, i = [], clock() + seconds, 0
    while clock() < end:
        times.append(step(i % HOLD_CYCLE))
        i += 1
    release()
    return times


def paired_step_times(first, second, batch_size: int, context: int, steps: int, seed: int,
                      block_size: int) -> tuple[list[float], list[float]]:
    """step_times of two runners (the same prompts and tokens), one step of each in turn, ABBA by step: step i of
    each lies one step from the other's, so a slow spell of a shared CPU (seconds long) falls on both."""
    runs = [_filled(runner, batch_size, context, steps, seed, block_size) for runner in (first, second)]
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append(runs[side][0](i))
    for _, release in runs:
        release()
    return times


def _max_len(args) -> int:
    """The positions a run needs: its context, then its steps (or a held run's cycle) and the 5 untimed ones."""
    return args.context + max(args.steps, HOLD_CYCLE if args.hold else 0) + 6


def _check_context(model_dir: Path, args) -> None:
    """A ConfigError naming --context, before the model loads, where the positions the run needs pass the ones the
    model was trained for (the runner's own error names a max_model_len the user never gave)."""
    try:
        check_max_model_len(json.loads((model_dir / "config.json").read_text()), _max_len(args))
    except ConfigError:
        raise ConfigError(f"--context {args.context} is over the model's limit: the run needs {_max_len(args)} "
                          f"positions (the context, then its steps), the model has {model_positions(model_dir)} "
                          "(max_position_embeddings)") from None


def _load_runner(model_dir: Path, cfg, args, compressed: str | None) -> TorchRunner:
    max_len = _max_len(args)
    runner = TorchRunner(model_dir, max_len, cfg.model.dtype, cfg.device,
                         Path(compressed) if compressed else None, num_threads=args.num_threads,
                         panel_gemm=not args.no_panel_gemm, kv_cache_dtype=cfg.engine.kv_cache_dtype,
                         quantization=cfg.model.quantization, gguf_source=gguf_source(cfg.model))
    runner.load()
    runner.model.use_decoder_plan = not args.python_layers
    runner.allocate_kv_blocks(max(args.batch_sizes) * -(-max_len // cfg.engine.block_size), cfg.engine.block_size)
    return runner


def ab_rows(dense: TorchRunner, compressed: TorchRunner, args, block_size: int) -> list[dict]:
    """Per batch size: the step p50 of each side in every round (ABBA order) and speed-up = dense / compressed per
    round, summarised by its median and range. With `args.ab_paired` a round runs both sides step by step in turn
    (paired_step_times) and its speed-up is the median of its per-step ratios."""
    rows = []
    for bs in args.batch_sizes:
        medians = {"dense": [], "compressed": []}
        ratios, round_trips = [], []
        for r in tqdm(range(args.ab_rounds), desc=f"A/B rounds, batch {bs}"):
            round_trips.append(core_round_trip_ns())  # the vCPUs' placement can change between rounds
            if args.ab_paired:
                d, c = (t[5:] for t in paired_step_times(dense, compressed, bs, args.context, args.steps + 5,
                                                         args.seed + r, block_size))
                ratios.append(statistics.median(a / b for a, b in zip(d, c)))
                medians["dense"].append(1000 * statistics.median(d))
                medians["compressed"].append(1000 * statistics.median(c))
                continue
            order = [("dense", dense), ("compressed", compressed)]
            for name, runner in order if r % 2 == 0 else order[::-1]:
                times = step_times(runner, bs, args.context, args.steps + 5, args.seed + r, block_size)[5:]
                medians[name].append(1000 * statistics.median(times))
            ratios.append(medians["dense"][-1] / medians["compressed"][-1])
        rows.append({"batch_size": bs, "dense_step_ms": medians["dense"], "compressed_step_ms": medians["compressed"],
                     "speedup": ratios, "core_round_trip_ns": round_trips, "speedup_median": statistics.median(ratios),
                     "speedup_min": min(ratios), "speedup_max": max(ratios)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry: time decode steps per batch size, print a table, save JSON."""
    p = argparse.ArgumentParser(prog="bench.engine_step", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--context", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=30, help="timed steps per batch size (first 5 dropped)")
    p.add_argument("--num-threads", type=positive_int, default=None)
    p.add_argument("--compressed", help="a compressed artifact folder to apply (default: the config's)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="override the config's engine.kv_cache_dtype")
    p.add_argument("--quantization", choices=["int8", "gguf", "none"], help="override the config's model.quantization")
    p.add_argument("--no-panel-gemm", action="store_true", help="oneDNN's packed GEMM even where the panel GEMM applies")
    p.add_argument("--python-layers", action="store_true",
                   help="run the layers through the Python loop even where the C++ layer loop (csrc/decoder.cpp) applies")
    p.add_argument("--ab-rounds", type=nonnegative_int, default=0,
                   help="with --compressed: time dense and compressed in this many alternating rounds (one process)")
    p.add_argument("--ab-paired", action="store_true",
                   help="with --ab-rounds: each round alternates the two models step by step (ABBA), its speed-up the "
                        "median of the per-step ratios, instead of a run of steps of each")
    p.add_argument("--region-times", action="store_true",
                   help="after the timed steps, as many again with the parallel regions' clocks on: per step, the "
                        "fork, tail and join of the GEMM and attention regions, and the time outside them")
    p.add_argument("--hold", type=nonnegative_float, default=0.0, metavar="SECONDS",
                   help="then keep stepping the last batch size this long at a fixed context, for a profiler to "
                        "attach (the process id is printed first)")
    p.add_argument("--out", default=str(RESULTS / "engine_step.json"))
    args = p.parse_args(argv)
    if args.ab_rounds and not args.compressed:
        p.error("--ab-rounds needs --compressed (the artifact to compare with the dense model)")
    if args.ab_paired and not args.ab_rounds:
        p.error("--ab-paired needs --ab-rounds (the number of rounds)")
    if args.region_times and args.ab_rounds:
        p.error("--region-times times one model's steps: leave out --ab-rounds")
    if args.hold and args.ab_rounds:
        p.error("--hold steps one model: leave out --ab-rounds")
    if args.region_times and not fused_ops.load():
        p.error("--region-times needs the fused CPU ops (csrc/), which this machine cannot build")
    args.out = check_out(args.out, markdown=False)

    cfg = load_config(args.config)
    if args.kv_cache_dtype:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kv_cache_dtype": args.kv_cache_dtype})})
    if args.quantization:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"quantization": args.quantization})})
    model_dir = resolve_model_dir(cfg.model, Path(cfg.cache_dir).expanduser())
    _check_context(model_dir, args)
    compressed = args.compressed or cfg.model.compressed
    with startup_heap("engine step"):  # the server's engine core runs with its start-up heap frozen (server.gc_heap)
        runner = _load_runner(model_dir, cfg, args, compressed)
    block_size = cfg.engine.block_size  # the paged cache the server runs
    if args.ab_rounds:
        return _main_ab(args, cfg, model_dir, runner, block_size)
    rows = []
    with torch.inference_mode():
        for bs in tqdm(args.batch_sizes, desc="batch sizes"):
            times = step_times(runner, bs, args.context, args.steps + 5, args.seed, block_size)[5:]
            median = statistics.median(times)
            rows.append({"batch_size": bs, "step_ms_p50": 1000 * median,
                         "step_ms_min": 1000 * min(times), "tok_s": bs / median})
            if args.region_times:
                rows[-1]["regions"] = region_times(runner, bs, args.context, args.steps + 5, args.seed, block_size)
        if args.hold:
            print(f"holding batch {rows[-1]['batch_size']} at {args.context} positions for {args.hold:g} s: "
                  f"pid {os.getpid()}", flush=True)
            held = held_step_times(runner, rows[-1]["batch_size"], args.context, args.hold, args.seed, block_size)
            rows[-1]["held"] = {"seconds": args.hold, "steps": len(held),
                                "step_ms_p50": 1000 * statistics.median(held) if held else None}
    arithmetic = TokenArithmetic.of(runner.model)
    peak = gemm_peak(runner_gemm_kind(runner))
    for r in rows:
        flops = arithmetic.decode_step_flops(r["batch_size"], median_context(args))
        r["gflop"] = flops / 1e9
        r["compute_floor_ms"] = flops / peak["gops"] / 1e6 if peak else None
        r["kv_bytes"] = step_kv_bytes(runner, r["batch_size"], args)
    result = {**_facts(args, runner, compressed, block_size), "weight_bytes": weight_bytes(runner.model),
              "kv_bytes_per_position": runner.kv_bytes_per_token(),
              "arithmetic": dataclasses.asdict(arithmetic), "gemm_peak": peak, "rows": rows}
    print("| batch | step p50 ms | step min ms | decode tok/s | GFLOP | compute floor ms |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        floor = "-" if r["compute_floor_ms"] is None else f"{r['compute_floor_ms']:.1f}"
        print(f"| {r['batch_size']} | {r['step_ms_p50']:.1f} | {r['step_ms_min']:.1f} | {r['tok_s']:.1f} | "
              f"{r['gflop']:.2f} | {floor} |")
    if peak:
        print(f"\ncompute floor: the step's FLOPs at this machine's {peak['kind']} peak, {peak['gops']:.1f} G/s "
              "(bench.peak_rate)")
    if args.hold and rows[-1]["held"]["steps"]:
        held = rows[-1]["held"]
        print(f"\nheld: {held['steps']} steps of batch {rows[-1]['batch_size']}, p50 {held['step_ms_p50']:.1f} ms")
    if args.region_times:
        print("\n| batch | regions a step | fork ms | tail ms | join ms | barrier ms | in regions ms | outside ms | "
              "step ms |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            t = r["regions"]
            print(f"| {r['batch_size']} | {t['regions']:.0f} | {t['fork_ms']:.3f} | {t['tail_ms']:.3f} | "
                  f"{t['join_ms']:.3f} | {t['barrier_ms']:.3f} | {t['in_regions_ms']:.2f} | "
                  f"{t['outside_regions_ms']:.2f} | {t['step_ms']:.2f} |")
    _save(args.out, result)
    return 0


def _kernels() -> dict | None:
    """The bf16 panel GEMM's row thresholds this process tuned (None where no bf16 panels were packed)."""
    chosen = bf16_kernels()
    return None if chosen is None else {"fma_rows": chosen.fma_rows, "amx_rows": chosen.amx_rows}


def median_context(args) -> int:
    """The positions the median timed step attends (step i of the 5 untimed and args.steps timed ones writes position
    args.context + i): the step a row's FLOPs and floors are for."""
    return args.context + 6 + args.steps // 2


def step_kv_bytes(runner: TorchRunner, batch: int, args) -> int:
    """Bytes of KV cache the median timed step's attention reads: every cached position of each sequence."""
    return batch * median_context(args) * runner.kv_bytes_per_token()


def _facts(args, runner: TorchRunner, compressed: str | None, block_size: int) -> dict:
    return {**machine_facts(), "machine": platform.machine(), "torch_threads": torch.get_num_threads(), "config": args.config, "compressed": compressed,
            "panel_gemm": not args.no_panel_gemm, "bf16_kernels": _kernels(),
            "decoder_plan": runner.model.use_decoder_plan and runner.model.decoder_plan() is not None,
            "dtype": runner.precision, "kv_cache_dtype": str(runner.cache_dtype).removeprefix("torch."),
            "context": args.context, "block_size": block_size, "steps_per_round": args.steps}


def _save(out: Path, result: dict) -> None:
    write_json_atomic(out, result)
    print(f"saved {out}")


def _main_ab(args, cfg, model_dir: Path, compressed: TorchRunner, block_size: int) -> int:
    with startup_heap("engine step, dense"):
        dense = _load_runner(model_dir, cfg, args, None)
    with torch.inference_mode():
        rows = ab_rows(dense, compressed, args, block_size)
    sides = {"dense": dense, "compressed": compressed}
    arithmetic = {name: TokenArithmetic.of(runner.model) for name, runner in sides.items()}
    weights = {name: weight_bytes(runner.model) for name, runner in sides.items()}
    for r in rows:  # the speed-ups a step bound by its FLOPs alone, or by the bytes it reads, would show
        flops = {name: a.decode_step_flops(r["batch_size"], median_context(args))
                 for name, a in arithmetic.items()}
        r["flops_ratio"] = flops["dense"] / flops["compressed"]
        r["kv_bytes"] = step_kv_bytes(compressed, r["batch_size"], args)  # the same cache on both sides
        r["bytes_ratio"] = (weights["dense"] + r["kv_bytes"]) / (weights["compressed"] + r["kv_bytes"])
    result = {**_facts(args, compressed, args.compressed, block_size), "ab_rounds": args.ab_rounds, "ab_paired": args.ab_paired,
              "weight_bytes": weights, "kv_bytes_per_position": compressed.kv_bytes_per_token(),
              "arithmetic": {name: dataclasses.asdict(a) for name, a in arithmetic.items()}, "rows": rows}
    print("| batch | dense step p50 ms (rounds) | compressed | speed-up median (min-max) | bytes ratio | FLOPs ratio "
          "| core round trip ns (before each round) |\n|---:|---|---|---|---:|---:|---|")
    for r in rows:
        trips = " ".join("-" if t is None else f"{t:.0f}" for t in r["core_round_trip_ns"])
        print(f"| {r['batch_size']} | {' '.join(f'{t:.1f}' for t in r['dense_step_ms'])} | "
              f"{' '.join(f'{t:.1f}' for t in r['compressed_step_ms'])} | {r['speedup_median']:.3f} "
              f"({r['speedup_min']:.3f}-{r['speedup_max']:.3f}) | {r['bytes_ratio']:.3f} | {r['flops_ratio']:.3f} | "
              f"{trips} |")
    print("\nthe speed-up's bounds: the bytes ratio where a step streams what it reads (weight bytes plus the KV "
          "cache its attention reads, dense over compressed), the FLOPs ratio where it computes (bench.model_costs)")
    _save(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
