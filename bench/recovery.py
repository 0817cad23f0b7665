"""LoRA recovery on the default model: whitened uniform vs + recovery, perplexity and the gap closed.

For each keep ratio: `neuronmm compress` (whitened, MLP) into <work>/whitened-k<keep> unless it exists,
a copy recovered with `neuronmm recover` (wall time and peak RSS of that process), then `neuronmm eval`
on dense, whitened and recovered. Gap closed = (ppl_whitened - ppl_recovered) / (ppl_whitened - ppl_dense).
Writes JSON (+ .md table) after every row, so an interrupted run keeps what finished.

    .venv/bin/python -m bench.recovery --keeps 0.8 --steps 100 --out bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
from pathlib import Path

from bench.compression_quality import NEURONMM, REPO, _run

CORPORA = ("wikitext2", "ptb", "c4")


def _eval(args, work: Path, label: str, artifact: Path | None) -> dict:
    out = work / f"eval-{label}.json"
    if not (args.reuse and out.is_file()):
        cmd = NEURONMM + ["eval", "--config", args.config, "--seqlen", str(args.eval_seqlen), "--ppl", args.ppl,
                          "--ppl-limit", str(args.ppl_limit), "--tasks", args.tasks, "--num-threads", "2",
                          "--label", label, "--out", str(out)]
        if args.tasks != "none":
            cmd += ["--task-limit", str(args.task_limit)]
        if artifact:
            cmd += ["--compressed", str(artifact)]
        wall, _ = _run(cmd, work / f"eval-{label}.log")
        print(f"  eval {label}: {wall:.0f} s", flush=True)
    return json.loads(out.read_text())


def _ppl(result: dict) -> dict[str, float]:
    """{corpus: perplexity} from an eval result, whatever nesting `neuronmm eval` uses."""
    found = {}
    ppl = result.get("perplexity", result.get("ppl", {}))
    for corpus in CORPORA:
        value = ppl.get(corpus) if isinstance(ppl, dict) else None
        if isinstance(value, dict):
            value = value.get("ppl", value.get("perplexity"))
        if value is not None:
            found[corpus] = float(value)
    return found


def _compress(args, work: Path, keep: float) -> Path:
    artifact = work / f"whitened-k{keep}-m{args.rank_multiple}"
    if not (artifact / "manifest.json").is_file():
        cmd = NEURONMM + ["compress", "--config", args.config, "--keep-ratio", str(keep), "--method", "whitened",
                          "--targets", "mlp", "--rank-multiple", str(args.rank_multiple), "--calib-samples",
                          str(args.calib_samples), "--out", str(artifact)]
        wall, rss = _run(cmd, work / f"{artifact.name}.log")
        print(f"  compress keep {keep}: {wall:.0f} s, peak {rss:.0f} MiB", flush=True)
    return artifact


def _recover(args, work: Path, whitened: Path) -> tuple[Path, dict]:
    recovered = work / f"{whitened.name}-lora{args.steps}"
    if not (args.reuse and (recovered / "manifest.json").is_file()):
        cmd = NEURONMM + ["recover", "--artifact", str(whitened), "--config", args.config, "--out", str(recovered),
                          "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seqlen",
                          str(args.seqlen), "--adapter-rank", str(args.adapter_rank), "--lr", str(args.lr)]
        wall, rss = _run(cmd, work / f"{recovered.name}.log")
        print(f"  recover: {wall:.0f} s, peak RSS {rss:.0f} MiB", flush=True)
        (recovered / "bench-process.json").write_text(json.dumps({"process_wall_s": wall, "peak_rss_mib": rss}))
    proc = json.loads((recovered / "bench-process.json").read_text())
    block = json.loads((recovered / "manifest.json").read_text())["recovery"]
    return recovered, dict(block, process_wall_s=round(proc["process_wall_s"], 1),
                           process_peak_rss_mib=round(proc["peak_rss_mib"], 1))


def markdown(result: dict) -> str:
    """The results table."""
    lines = ["| keep | row | " + " | ".join(CORPORA) + " | gap closed (wikitext2) | steps | tokens | recovery wall s | peak RSS MiB |",
             "|---|---|" + "---|" * len(CORPORA) + "---|---|---|---|---|"]
    for row in result["rows"]:
        ppl = row["ppl"]
        cells = [f"{ppl[c]:.2f}" if c in ppl else "-" for c in CORPORA]
        rec = row.get("recovery") or {}
        gap = row.get("gap_closed", {}).get("wikitext2")
        lines.append(f"| {row.get('keep_ratio', '-')} | {row['label']} | " + " | ".join(cells) +
                     f" | {'-' if gap is None else f'{gap:.0%}'} | {rec.get('steps', '-')} | {rec.get('tokens', '-')}"
                     f" | {rec.get('process_wall_s', '-')} | {rec.get('process_peak_rss_mib', '-')} |")
    return "\n".join(lines)


def _write(args, rows: list[dict], complete: bool) -> None:
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs (timings noisy)",
              "command": shlex.join([sys.executable, "-m", "bench.recovery", *sys.argv[1:]]),
              "eval": {"seqlen": args.eval_seqlen, "ppl_windows": args.ppl_limit, "corpora": args.ppl},
              "complete": complete, "rows": rows}
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result) + "\n")


def run(args) -> None:
    """Compress, recover and evaluate every keep ratio; JSON after each row."""
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    dense = _ppl(_eval(args, work, "dense", None))
    rows = [{"label": "dense", "ppl": dense}]
    _write(args, rows, complete=False)
    for keep in [float(k) for k in args.keeps.split(",")]:
        whitened = _compress(args, work, keep)
        w_ppl = _ppl(_eval(args, work, whitened.name, whitened))
        manifest = json.loads((whitened / "manifest.json").read_text())
        ranks = sorted({m.get("rank") for m in manifest.get("modules", {}).values() if isinstance(m, dict)}, key=str)
        rows.append({"label": "whitened uniform", "keep_ratio": keep, "artifact": whitened.name, "ppl": w_ppl,
                     "ranks": ranks, "calibration": manifest.get("calibration")})
        _write(args, rows, complete=False)
        recovered, block = _recover(args, work, whitened)
        r_ppl = _ppl(_eval(args, work, recovered.name, recovered))
        gap = {c: (w_ppl[c] - r_ppl[c]) / (w_ppl[c] - dense[c]) for c in r_ppl if c in w_ppl and c in dense
               and w_ppl[c] != dense[c]}
        rows.append({"label": "whitened uniform + LoRA recovery", "keep_ratio": keep, "artifact": recovered.name,
                     "ppl": r_ppl, "gap_closed": gap, "recovery": block})
        _write(args, rows, complete=False)
    _write(args, rows, complete=True)
    print(markdown(json.loads((REPO / args.out).read_text())))


def main(argv: list[str] | None = None) -> None:
    """CLI entry."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--keeps", default="0.8")
    p.add_argument("--rank-multiple", type=int, default=32)
    p.add_argument("--calib-samples", type=int, default=64, help="compression calibration windows (x 512)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--adapter-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-seqlen", type=int, default=512)
    p.add_argument("--ppl", default="wikitext2")
    p.add_argument("--ppl-limit", type=int, default=40)
    p.add_argument("--tasks", default="none")
    p.add_argument("--task-limit", type=int, default=50)
    p.add_argument("--work-dir", default="/tmp/neuronmm-recovery-bench")
    p.add_argument("--reuse", action="store_true", help="reuse finished evals/recoveries in --work-dir")
    p.add_argument("--out", default="bench/results/recovery.json")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
