"""bench.serve's workload run through the engine in-process: what the served numbers would be with no HTTP.

Same prompts (distinct random tokens), same concurrency and output length as a `bench.serve` level, fed
to `LLMEngine` directly: a request is added as soon as one finishes, and every step is timed. A decode
step here is the served ITL's engine-only counterpart at the same batch and the same contexts (scheduler,
forward, sampler and detokeniser included), so `served ITL p50 / decode step p50` is what the serving
side (API process, pipe, SSE, the client on the same cores) adds. `bench.engine_step` times the model's
forward alone at a fixed context instead. Each level also states its FLOPs (bench.model_costs) and the ceiling they
allow: at the vector units' peak (bench.peak_rate), or, where that is longer, its fewest steps each streaming the
weights at the read bandwidth (bench.read_bandwidth), both measured after the levels.

    python -m bench.engine_workload --concurrency 1 16

With --levels-from-stdin it loads the engine, says so (`{"ready": true}` after ROW_PREFIX), then runs one level per
line read (a concurrency), printing each level's row as one JSON line after ROW_PREFIX: `bench.serve` keeps it beside
a served system and runs a level right before and right after each served one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.harness import (KV_CACHE_DTYPES, MODEL_DTYPES, ROW_PREFIX, check_out, level_size, machine_facts,
                           nonnegative_int, positive_int, prompt_id_bound, publish, run_cli)
from bench.model_costs import (TokenArithmetic, ceiling_cell, ceiling_tok_s, level_kv_bytes, min_level_steps,
                               weight_bytes)
from bench.peak_rate import gemm_peak, runner_gemm_kind
from bench.read_bandwidth import read_bandwidth_gbs
from bench.step_parts import medians_ms, part_clocks, table
from server.config import load_config
from server.engine.sampling_params import SamplingParams
from server.gc_heap import startup_heap
from server.runtime import load_runtime

RESULTS = Path(__file__).parent / "results"


def run_level(engine, prompts: list[list[int]], concurrency: int, output_len: int, sampled: bool,
              clock: Callable[[], float] = time.perf_counter) -> dict:
    """All prompts at one concurrency level; output tok/s, the step times split by kind, and each request's TPOT
    (first to last token over the tokens between, as bench.serve's client times it).

    The level begins as a served one does: the client sends its first wave at once, but the requests reach the
    engine one by one and its first step starts with the first alone; the others wait for the next step, by which
    time that one is decoding (so a prefill cap beside decodes takes them one chunk a step, as served)."""
    if concurrency < 1:  # no request would ever be admitted: the loop would spin forever
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    next_prompt, live, out_tokens = 0, 0, 0
    decode_steps, other_steps = [], []
    first_at, last_at, tokens = {}, {}, {}  # per request: when its first and its latest token came, and how many
    start = clock()
    admit = 1  # the first step's share of the first wave, then as many as the level keeps in flight
    while next_prompt < len(prompts) or engine.has_work():
        while live < admit and next_prompt < len(prompts):
            params = SamplingParams(max_tokens=output_len, temperature=0.7 if sampled else 0.0, seed=next_prompt,
                                    ignore_eos=True)
            engine.add_request(f"w{next_prompt}", prompts[next_prompt], params)
            next_prompt, live = next_prompt + 1, live + 1
        admit = concurrency
        step_start = clock()
        outputs = engine.step()
        step_end = clock()
        took = step_end - step_start
        out_tokens += sum(len(o.token_ids) for o in outputs)
        for o in outputs:
            if o.token_ids:
                first_at.setdefault(o.request_id, step_end)
                last_at[o.request_id], tokens[o.request_id] = step_end, o.num_output_tokens
        first_tokens = sum(1 for o in outputs if o.num_output_tokens == 1)
        # a decode step of a full batch: what a served ITL at this concurrency waits for
        (decode_steps if first_tokens == 0 and len(outputs) >= min(concurrency, live) else other_steps).append(took)
        live -= sum(1 for o in outputs if o.finish_reason)
    duration = clock() - start
    tpots = [(last_at[r] - first_at[r]) / (tokens[r] - 1) for r in first_at if tokens[r] > 1]
    return {"concurrency": concurrency, "num_prompts": len(prompts), "sampled": sampled,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / duration, "duration_s": duration,
            "tpot_ms_p50": 1e3 * statistics.median(tpots) if tpots else float("nan"),
            "decode_step_ms_p50": 1e3 * statistics.median(decode_steps) if decode_steps else float("nan"),
            "num_decode_steps": len(decode_steps), "other_steps_s": sum(other_steps),
            "num_other_steps": len(other_steps)}


def measure_level(engine, rng: random.Random, vocab: int, concurrency: int, input_len: int, output_len: int,
                  sampled: bool, step_parts: bool = False) -> dict:
    """One level on fresh prompts, after a short warm-up of this batch size's shapes on prompts of its own: warmed
    on the level's first prompts, the engine's prefix cache held them, and the level skipped a ninth of its prefill
    at c=16 (448 of 4,096 prompt tokens), which bench.serve's levels, on prompts never sent before, do not. With
    step_parts, the level's steps also time their parts (bench.step_parts): `step_parts_ms`, medians per part."""
    def fresh(n: int) -> list[list[int]]:
        return [[rng.randrange(1000, vocab) for _ in range(input_len)] for _ in range(n)]

    run_level(engine, fresh(min(concurrency, 4)), concurrency, 8, sampled)
    prompts = fresh(level_size(concurrency))
    if not step_parts:
        return run_level(engine, prompts, concurrency, output_len, sampled)
    with part_clocks(engine) as times:
        row = run_level(engine, prompts, concurrency, output_len, sampled)
    return {**row, "step_parts_ms": medians_ms(times)}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run each level in-process, print a table, save JSON + markdown."""
    p = argparse.ArgumentParser(prog="bench.engine_workload", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--compressed", help="a compressed artifact folder to apply (default: the config's)")
    p.add_argument("--dtype", choices=MODEL_DTYPES, help="override the config's model dtype (e.g. float32)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="override the config's engine.kv_cache_dtype (e.g. float16)")
    p.add_argument("--quantization", choices=["int8", "gguf", "none"], help="override the config's model.quantization")
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--sampled", action="store_true", help="temperature 0.7, seeded per request (else greedy)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", default=str(RESULTS / "engine_workload.json"))
    p.add_argument("--step-parts", action="store_true",
                   help="also time each step's parts (the C++ layer loop, the LM head, the sampler, the scheduler) "
                        "and print where the rest, the Python and glue, goes (bench.step_parts)")
    p.add_argument("--levels-from-stdin", action="store_true",
                   help="run one level per concurrency read from stdin, printing its row on stdout (for bench.serve)")
    args = p.parse_args(argv)
    out = None if args.levels_from_stdin else check_out(args.out)  # that mode writes no report
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    cfg = load_config(args.config)
    model = {"compressed": args.compressed} if args.compressed else {}
    if args.dtype:
        model["dtype"] = args.dtype
    if args.quantization:
        model["quantization"] = args.quantization
    if model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=model)})
    if args.kv_cache_dtype:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kv_cache_dtype": args.kv_cache_dtype})})
    with startup_heap("engine workload"):  # as the server's engine core starts (server.gc_heap)
        engine = load_runtime(cfg).engine
    vocab = prompt_id_bound(engine.runner.vocab_size, engine.tokenizer)
    rng = random.Random(args.seed)
    runner = engine.runner
    arithmetic = TokenArithmetic.of(runner.model)
    kind = runner_gemm_kind(runner)
    step_bytes = weight_bytes(runner.model)

    def level(c: int) -> dict:
        row = measure_level(engine, rng, vocab, c, args.input_len, args.output_len, args.sampled, args.step_parts)
        prompts = [args.input_len] * row["num_prompts"]
        flops = arithmetic.level_flops(prompts, args.output_len)
        kv = level_kv_bytes(prompts, args.output_len, runner.kv_bytes_per_token())
        return {**row, "gflop": flops / 1e9, "gemm_kind": kind, "weight_bytes": step_bytes, "kv_bytes": kv}

    if args.levels_from_stdin:
        print(ROW_PREFIX + json.dumps({"ready": True}), flush=True)  # loaded (and its GEMM paths timed) by now
        for line in sys.stdin:
            print(ROW_PREFIX + json.dumps(level(int(line))), flush=True)
        return 0
    rows = [level(c) for c in args.concurrency]
    peak, bandwidth = gemm_peak(kind), read_bandwidth_gbs(2**29)  # after the levels, with nothing beside them
    for r in rows:
        steps = min_level_steps(r["num_prompts"], r["concurrency"], args.output_len)
        r["ceiling_tok_s"] = ceiling_tok_s(r["output_tokens"], r["gflop"], peak, steps, step_bytes, bandwidth,
                                           r["kv_bytes"])
    report = {**machine_facts(), "config": args.config, "compressed": args.compressed, "dtype": runner.precision,
              "kv_cache_dtype": str(runner.cache_dtype).removeprefix("torch."), "input_len": args.input_len,
              "output_len": args.output_len, "arithmetic": dataclasses.asdict(arithmetic),
              "gemm_peak": peak, "weight_bytes": step_bytes, "memory_bandwidth_gbs": bandwidth, "rows": rows}
    lines = ["| c | output tok/s | decode step p50 ms | decode steps | other steps (s) | GFLOP | ceiling tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['output_tok_s']:.1f} | {r['decode_step_ms_p50']:.1f} | {r['num_decode_steps']} | "
              f"{r['num_other_steps']} ({r['other_steps_s']:.2f}) | {r['gflop']:.0f} | "
              f"{ceiling_cell(r['ceiling_tok_s'])} |"
              for r in rows]
    if peak:
        lines += ["", f"ceiling: the level's FLOPs (bench.model_costs) at this machine's {peak['kind']} peak, "
                  f"{peak['gops']:.1f} G/s (bench.peak_rate), or where longer its fewest steps each streaming the "
                  f"{step_bytes / 1e6:.0f} MB of weights, and its decode steps the KV cache they attend, at "
                  f"{bandwidth:.1f} GB/s (bench.read_bandwidth)"]
    if args.step_parts:
        lines += ["", "Each step's parts, medians over the level's steps (ms; bench.step_parts):", "", table(rows)]
    return publish(out, report, "\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_cli(main))
