"""Where in a long window a compressed model loses: per-position NLL against dense on WikiText-2 (issue 18).

Both models are loaded as `neuronmm eval` loads them (compression.evaluation.model.load_eval_model, fp32); the
same evenly spaced windows of the WikiText-2 test set (the perplexity protocol's tokenization and windows) are
scored token by token, and the mean NLL per position is compared in buckets. A gap that grows with the position
says recovery on short windows left long-range behaviour unrepaired; a flat one says it did not.

    .venv/bin/python -m bench.position_nll --compressed DIR --windows 12 --out bench/results/position_nll.json
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import platform
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.harness import check_out, int_at_least, machine_facts, positive_int, run_cli, save_report
from compression.evaluation.corpora import corpus_text
from compression.evaluation.model import load_eval_model
from compression.evaluation.perplexity import token_windows
from server.config import load_config
from server.models.artifact import read_manifest

EDGES = (0, 64, 256, 512, 1024, 2048)


def spread_windows(windows: torch.Tensor, count: int) -> torch.Tensor:
    """`count` windows evenly spaced over the test set (first and last included), or all of them."""
    if count >= len(windows):
        return windows
    return windows[torch.linspace(0, len(windows) - 1, count).round().long()]


@torch.inference_mode()
def position_nll(model, windows: torch.Tensor, desc: str) -> torch.Tensor:
    """Mean NLL (float64) of predicting token t+1 at each position t = 0 … L-2, over the windows."""
    total = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    for window in tqdm(windows, desc=desc, unit="window"):
        logits = model(input_ids=window[None], use_cache=False).logits[0, :-1].float()
        total += F.cross_entropy(logits, window[1:], reduction="none").double()
    return total / len(windows)


def bucket_rows(dense: torch.Tensor, compressed: torch.Tensor, edges: tuple[int, ...] = EDGES) -> list[dict]:
    """Per position bucket [lo, hi): perplexities exp(mean NLL) of both, and their ratio exp(ΔNLL)."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        hi = min(hi, len(dense))
        if lo >= hi:
            break
        d, c = float(dense[lo:hi].mean()), float(compressed[lo:hi].mean())
        rows.append({"positions": [lo, hi], "dense_ppl": math.exp(d), "compressed_ppl": math.exp(c),
                     "ratio": math.exp(c - d)})
    return rows


def markdown(report: dict) -> str:
    """The bucket table."""
    lines = ["| positions | dense ppl | compressed ppl | × dense |", "|---|---:|---:|---:|"]
    for r in report["buckets"]:
        lo, hi = r["positions"]
        lines.append(f"| {lo}-{hi} | {r['dense_ppl']:.2f} | {r['compressed_ppl']:.2f} | {r['ratio']:.3f} |")
    lines.append(f"| all | {report['dense_ppl']:.2f} | {report['compressed_ppl']:.2f} | {report['ratio']:.3f} |")
    lines.append("")
    lines.append(f"WikiText-2, {report['windows']} of {report['windows_total']} windows of {report['seqlen']} "
                 f"tokens, {report['compressed']}; `{report['command']}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.position_nll", description=__doc__.splitlines()[0])
    p.add_argument("--compressed", required=True, help="a compressed artifact folder")
    p.add_argument("--config", default=None)
    p.add_argument("--seqlen", type=int_at_least(2), default=2048)  # a window scores its tokens after the first
    p.add_argument("--windows", type=positive_int, default=12, help="evenly spaced windows of the test set")
    p.add_argument("--num-threads", type=positive_int, default=2)
    p.add_argument("--out", default="bench/results/position_nll.json")
    args = p.parse_args(argv)
    out = check_out(args.out)
    read_manifest(Path(args.compressed))  # a bad artifact is found before the dense model's pass, not after it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    nll, windows, windows_total = {}, None, 0
    for name, compressed in (("dense", None), ("compressed", args.compressed)):
        model, tokenizer, _ = load_eval_model(cfg, compressed, args.num_threads)
        if windows is None:  # both models share the tokenizer: the same windows for both
            ids = torch.tensor(tokenizer(corpus_text("wikitext2"), verbose=False)["input_ids"], dtype=torch.long)
            all_windows = token_windows(ids, args.seqlen)
            windows_total, windows = len(all_windows), spread_windows(all_windows, args.windows)
        nll[name] = position_nll(model, windows, name)
        del model
    dense, comp = nll["dense"], nll["compressed"]
    report = {**machine_facts(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": platform.machine(), "compressed": args.compressed, "seqlen": args.seqlen,
              "windows": len(windows), "windows_total": windows_total,
              "command": shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "bench.position_nll", *(argv or sys.argv[1:])]),
              "buckets": bucket_rows(dense, comp), "dense_ppl": math.exp(float(dense.mean())),
              "compressed_ppl": math.exp(float(comp.mean())), "ratio": math.exp(float(comp.mean() - dense.mean()))}
    md = markdown(report)
    print(md)
    save_report(out, report, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
