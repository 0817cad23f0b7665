"""Decode step time with LoRA adapters beside the base model: what serving adapters per row costs a step.

Loads the config's model with two random PEFT adapters of `--rank` on all seven projections of every layer, fills
the paged cache with one batch per variant (128-token random prompts), then times decode steps of the variants in
turn, step by step (so a slow spell of a shared CPU falls on all of them):

- base: no adapter row (the C++ layer loop, as without adapters);
- one adapter: every row through adapter a;
- mixed: rows split between the base, adapter a and adapter b (batch 1: adapter a alone).

    python -m bench.lora_step --batch-sizes 1 16 --rank 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig

from bench.engine_step import RESULTS, _filled, _save
from bench.harness import check_out, machine_facts, nonnegative_int, positive_int, run_cli, write_random_lora
from server.backends.torch_runner import TorchRunner
from server.config import load_config
from server.models.source import resolve_model_dir

VARIANTS = ("base", "one adapter", "mixed")


def _rows(variant: str, batch_size: int) -> list[str | None]:
    if variant == "base":
        return [None] * batch_size
    if variant == "one adapter" or batch_size == 1:
        return ["a"] * batch_size
    return [(None, "a", "b")[i % 3] for i in range(batch_size)]


def variant_step_ms(runner: TorchRunner, batch_size: int, context: int, steps: int, seed: int, block_size: int
                    ) -> dict[str, float]:
    """Median decode step (ms) of each variant, their steps interleaved (after 5 untimed each)."""
    runs = [_filled(runner, batch_size, context, steps, seed, block_size, first_slot=k * batch_size,
                    loras=_rows(v, batch_size)) for k, v in enumerate(VARIANTS)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(steps):
        order = range(len(VARIANTS)) if i % 2 == 0 else reversed(range(len(VARIANTS)))
        for k in order:
            times[VARIANTS[k]].append(runs[k][0](i))
    for _, release in runs:
        release()
    return {v: 1000 * statistics.median(t[5:]) for v, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: time the variants per batch size, print a table, save JSON."""
    p = argparse.ArgumentParser(prog="bench.lora_step", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--rank", type=positive_int, default=16, help="the adapters' rank")
    p.add_argument("--context", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=60,
                   help="timed steps per variant and batch size (first 5 dropped)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", default=str(RESULTS / "lora_step.json"))
    args = p.parse_args(argv)
    args.out = check_out(args.out, markdown=False)
    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model, Path(cfg.cache_dir).expanduser())
    block_size = cfg.engine.block_size
    max_len = args.context + args.steps + 6
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: write_random_lora(Path(tmp) / name, AutoConfig.from_pretrained(model_dir), rank=args.rank,
                                           alpha=2.0 * args.rank, seed=seed) for seed, name in enumerate(("a", "b"))}
        runner = TorchRunner(model_dir, max_len, cfg.model.dtype, cfg.device, lora_modules=folders,
                             max_lora_rank=args.rank)
        runner.load()
    runner.allocate_kv_blocks(len(VARIANTS) * max(args.batch_sizes) * -(-max_len // block_size), block_size)
    rows = []
    with torch.inference_mode():
        for bs in tqdm(args.batch_sizes, desc="batch sizes"):
            ms = variant_step_ms(runner, bs, args.context, args.steps + 5, args.seed, block_size)
            rows.append({"batch_size": bs, **{f"{v}_step_ms": t for v, t in ms.items()}})
    print(f"rank {args.rank}, {runner.precision}\n| batch | base ms | one adapter ms | mixed (base, a, b) ms |\n"
          "|---:|---:|---:|---:|")
    for r in rows:
        base, one, mixed = r["base_step_ms"], r["one adapter_step_ms"], r["mixed_step_ms"]
        print(f"| {r['batch_size']} | {base:.1f} | {one:.1f} ({one / base:.2f} x) | {mixed:.1f} ({mixed / base:.2f} x) |")
    _save(args.out, {**machine_facts(), "config": args.config, "dtype": runner.precision, "rank": args.rank,
                     "context": args.context, "steps": args.steps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
