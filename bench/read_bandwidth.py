"""Read bandwidth by working-set size: how much of a decode step's weights the CPU's caches hold.

A decode step reads every weight once. When all of them fit in the last-level cache a step streams them at
cache speed; when they do not, the caches evict each weight before the next step needs it again (a cyclic
sweep larger than an LRU cache misses on every line) and the step runs at DRAM speed. Two readers run over a
resident tensor of each size with all threads: `torch.sum`, which leaves the prefetching to the hardware, and
the fused ops' streamed read (csrc/peak_rate.cpp), which prefetches 8 KB ahead as the GEMM tiles do. A core's own
draw from memory caps each stream, and the software prefetch keeps more lines on their way: over 512 MB on an
Emerald Rapids Xeon the streamed read ran 0.98-2.3 x as fast as the sum in the same runs (faster in nine of ten),
at the pace the GEMMs stream their weights. The memory floors divide by the faster of the two.

    python -m bench.read_bandwidth --sizes-mb 16 64 128 256 512
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.harness import check_out, machine_facts, positive_int, run_cli
from server.fileio import write_json_atomic
from server.models import fused_ops
from server.models.hugepages import huge_page_buffer

RESULTS = Path(__file__).parent / "results"


def summed_gbs(nbytes: int, repeats: int = 5) -> float:
    """GB/s of the fastest of `repeats` full sums over one resident fp32 tensor of `nbytes` (after a warm-up sum)."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def streamed_gbs(nbytes: int, repeats: int = 5) -> float | None:
    """GB/s of the fastest of `repeats` prefetched vector reads of one resident huge-page buffer of `nbytes`, every
    thread its share (None where the fused ops cannot be built)."""
    if not fused_ops.load():
        return None
    data = huge_page_buffer(max(nbytes, 128 * torch.get_num_threads()))
    data.fill_(1)  # backs every page before the timed passes
    return torch.ops.neuronmm.stream_read_rate(data, repeats) / 1e9


def readings(nbytes: int, repeats: int = 5) -> dict:
    """Both readers' GB/s over a working set of `nbytes` (streamed: None without the fused ops) and the faster."""
    summed, streamed = summed_gbs(nbytes, repeats), streamed_gbs(nbytes, repeats)
    return {"summed_gbs": summed, "streamed_gbs": streamed, "gbs": max(summed, streamed or 0.0)}


def read_bandwidth_gbs(nbytes: int, repeats: int = 5) -> float:
    """The memory floors' rate over a working set of `nbytes`: the faster of the summed and the streamed read."""
    return readings(nbytes, repeats)["gbs"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.read_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=positive_int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--out", default=str(RESULTS / "read_bandwidth.json"))
    args = p.parse_args(argv)
    out = check_out(args.out, markdown=False)
    rows = [{"mb": mb, **readings(mb * 2**20, args.repeats)} for mb in args.sizes_mb]
    print("| working set MB | torch.sum GB/s | streamed GB/s | read GB/s |\n|---:|---:|---:|---:|")
    for row in rows:
        streamed = "-" if row["streamed_gbs"] is None else f"{row['streamed_gbs']:.1f}"
        print(f"| {row['mb']} | {row['summed_gbs']:.1f} | {streamed} | {row['gbs']:.1f} |")
    report = {**machine_facts(), "torch_threads": torch.get_num_threads(), "rows": rows}
    write_json_atomic(out, report)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
