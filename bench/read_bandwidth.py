"""Read bandwidth by working-set size: how much of a decode step's weights the CPU's caches hold.

A decode step reads every weight once. When all of them fit in the last-level cache a step streams them at
cache speed; when they do not, the caches evict each weight before the next step needs it again (a cyclic
sweep larger than an LRU cache misses on every line) and the step runs at DRAM speed. This sums an fp32
tensor of each size repeatedly with all threads and reports GB/s, so a step's bytes can be read against the
right floor.

    python -m bench.read_bandwidth --sizes-mb 16 64 128 256 512
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.harness import BENCH_FLAGS
from server.models.cpu_features import cpu_flags

RESULTS = Path(__file__).parent / "results"


def read_bandwidth_gbs(nbytes: int, repeats: int = 5) -> float:
    """GB/s of the fastest of `repeats` full sums over one resident fp32 tensor of `nbytes` (after a warm-up sum)."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS / "read_bandwidth.json"))
    args = p.parse_args(argv)
    if any(mb <= 0 for mb in args.sizes_mb):
        p.error("--sizes-mb: sizes must be positive")
    rows = [{"mb": mb, "gbs": read_bandwidth_gbs(mb * 2**20, args.repeats)} for mb in args.sizes_mb]
    print("| working set MB | read GB/s |\n|---:|---:|")
    for row in rows:
        print(f"| {row['mb']} | {row['gbs']:.1f} |")
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "cpu_flags": sorted(cpu_flags() & BENCH_FLAGS), "torch_threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
