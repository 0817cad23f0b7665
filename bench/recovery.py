"""LoRA recovery and rank allocation on the default model: perplexity, zero-shot and the gap closed.

For each keep ratio and allocation (uniform, sensitivity): `neuronmm compress` (whitened, MLP) into
<work>/<allocation>-k<keep>-m<multiple> unless it exists, a copy recovered with `neuronmm recover` (wall
time and peak RSS of that process), then `neuronmm eval` on dense and on every artifact. The gap closed
of a row is measured against the whitened-uniform row of its keep ratio, the issue's definition:
(ppl_uniform - ppl_row) / (ppl_uniform - ppl_dense). Writes JSON (+ .md table) after every row, so an
interrupted run keeps what finished.

    .venv/bin/python -m bench.recovery --keeps 0.8,0.9 --allocations sensitivity,uniform --steps 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from bench.harness import (NEURONMM, REPO, check_out, comma_list, int_at_least, keep_ratio, machine_facts,
                           nonnegative_int, one_of, positive_float, positive_int, run_cli, run_logged, save_report)
from compression.evaluation.cli import check_eval_lists
from server.models.artifact import MANIFEST, read_manifest

CORPORA = ("wikitext2", "ptb", "c4")


def _eval(args, work: Path, label: str, artifact: Path | None) -> dict:
    out = work / f"eval-{label}.json"
    if not (args.reuse and out.is_file()):
        cmd = NEURONMM + ["eval", "--config", args.config, "--seqlen", str(args.eval_seqlen), "--ppl", args.ppl,
                          "--ppl-limit", args.ppl_limit, "--tasks", args.tasks, "--num-threads", "2",
                          "--label", label, "--out", str(out)]
        if args.tasks != "none":
            cmd += ["--task-limit", str(args.task_limit)]
        if artifact:
            cmd += ["--compressed", str(artifact)]
        wall, _ = run_logged(cmd, work / f"eval-{label}.log")
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


def _compress(args, work: Path, keep: float, allocation: str) -> Path:
    artifact = work / f"{allocation}-k{keep}-m{args.rank_multiple}"
    if not (artifact / MANIFEST).is_file():
        cmd = NEURONMM + ["compress", "--config", args.config, "--keep-ratio", str(keep), "--method", "whitened",
                          "--targets", "mlp", "--rank-multiple", str(args.rank_multiple), "--calib-samples",
                          str(args.calib_samples), "--out", str(artifact)]
        if allocation == "uniform":
            cmd += ["--allocation", "uniform"]
        else:  # sensitivity (Fisher-weighted) or sensitivity-normalised
            measure = "normalised" if allocation.endswith("-normalised") else "fisher"
            cmd += ["--allocation", "sensitivity", "--sensitivity", measure, "--latency-model", args.latency_model]
        wall, rss = run_logged(cmd, work / f"{artifact.name}.log")
        print(f"  compress {allocation} keep {keep}: {wall:.0f} s, peak {rss:.0f} MiB", flush=True)
        (artifact / "bench-process.json").write_text(json.dumps({"process_wall_s": wall, "peak_rss_mib": rss}))
    return artifact


def _recover(args, work: Path, whitened: Path) -> tuple[Path, dict]:
    recovered = work / f"{whitened.name}-lora{args.steps}"
    if not (args.reuse and (recovered / MANIFEST).is_file()):
        cmd = NEURONMM + ["recover", "--artifact", str(whitened), "--config", args.config, "--out", str(recovered),
                          "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seqlen",
                          str(args.seqlen), "--adapter-rank", str(args.adapter_rank), "--lr", str(args.lr)]
        wall, rss = run_logged(cmd, work / f"{recovered.name}.log")
        print(f"  recover: {wall:.0f} s, peak RSS {rss:.0f} MiB", flush=True)
        (recovered / "bench-process.json").write_text(json.dumps({"process_wall_s": wall, "peak_rss_mib": rss}))
    proc = json.loads((recovered / "bench-process.json").read_text())
    block = read_manifest(recovered).recovery
    return recovered, dict(block, process_wall_s=round(proc["process_wall_s"], 1),
                           process_peak_rss_mib=round(proc["peak_rss_mib"], 1))


def _gaps(rows: list[dict]) -> None:
    """Fill each compressed row's gap_closed against dense and the whitened-uniform row of its keep ratio."""
    dense = next((r["ppl"] for r in rows if r["label"] == "dense"), {})
    for row in rows:
        base = next((r["ppl"] for r in rows if r.get("keep_ratio") == row.get("keep_ratio")
                     and r["label"] == "whitened uniform"), None)
        if base is None or row["label"] in ("dense", "whitened uniform"):
            continue
        row["gap_closed"] = {c: (base[c] - row["ppl"][c]) / (base[c] - dense[c]) for c in row["ppl"]
                             if c in base and c in dense and base[c] != dense[c]}


def markdown(result: dict) -> str:
    """The results table."""
    lines = ["| keep | row | MLP params | " + " | ".join(CORPORA) + " | zero-shot mean acc | gap closed (wikitext2) "
             "| compress wall s | steps | tokens | recovery wall s | recovery peak RSS MiB |",
             "|---|---|---|" + "---|" * len(CORPORA) + "---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        ppl = row["ppl"]
        cells = [f"{ppl[c]:.2f}" if c in ppl else "-" for c in CORPORA]
        rec = row.get("recovery") or {}
        gap = row.get("gap_closed", {}).get("wikitext2")
        acc = row.get("zeroshot_mean_acc")
        lines.append(f"| {row.get('keep_ratio') or '-'} | {row['label']} | {row.get('mlp_params', '-')} | "
                     + " | ".join(cells) + f" | {'-' if acc is None else f'{100 * acc:.1f}'}"
                     f" | {'-' if gap is None else f'{gap:.0%}'}"
                     f" | {(row.get('compress') or {}).get('process_wall_s', '-')}"
                     f" | {rec.get('steps', '-')} | {rec.get('tokens', '-')}"
                     f" | {rec.get('process_wall_s', '-')} | {rec.get('process_peak_rss_mib', '-')} |")
    return "\n".join(lines)


def _write(args, rows: list[dict], complete: bool) -> None:
    result = {**machine_facts(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs (timings noisy)",
              "command": shlex.join([sys.executable, "-m", "bench.recovery", *sys.argv[1:]]),
              "eval": {"seqlen": args.eval_seqlen, "ppl_windows": args.ppl_limit, "corpora": args.ppl,
                       "tasks": args.tasks, "task_items": args.task_limit},
              "complete": complete, "rows": rows}
    _gaps(rows)
    save_report(REPO / args.out, result, markdown(result))


def _row(label: str, keep: float | None, artifact: Path | None, result: dict) -> dict:
    row = {"label": label, "keep_ratio": keep, "ppl": _ppl(result), "zeroshot_mean_acc": result.get("zeroshot_mean_acc"),
           "zeroshot": {t: r.get("acc") for t, r in (result.get("zeroshot") or {}).items()}}
    if artifact is not None:
        manifest = read_manifest(artifact)
        row.update(artifact=artifact.name, mlp_params=manifest.parameters.mlp_after,
                   mlp_ratio=manifest.parameters.mlp_ratio, allocation=manifest.allocation,
                   ranks={n: m.rank for n, m in manifest.modules.items()},
                   calibration=manifest.to_dict().get("calibration"))
        process = artifact / "bench-process.json"  # written by _compress (and _recover, for recovered copies)
        if manifest.recovery is None and process.is_file():
            proc = json.loads(process.read_text())
            row["compress"] = {"process_wall_s": round(proc["process_wall_s"], 1),
                               "process_peak_rss_mib": round(proc["peak_rss_mib"], 1)}
    return row


def run(args) -> None:
    """Compress, recover and evaluate every keep ratio and allocation; JSON after each row."""
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = [_row("dense", None, None, _eval(args, work, "dense", None))]
    _write(args, rows, complete=False)
    for keep in args.keeps:
        for allocation in args.allocations:
            artifact = _compress(args, work, keep, allocation)
            rows.append(_row(f"whitened {allocation}", keep, artifact, _eval(args, work, artifact.name, artifact)))
            _write(args, rows, complete=False)
            if args.steps <= 0:
                continue
            recovered, block = _recover(args, work, artifact)
            row = _row(f"whitened {allocation} + LoRA recovery", keep, recovered,
                       _eval(args, work, recovered.name, recovered))
            rows.append(dict(row, recovery=block))
            _write(args, rows, complete=False)
    _write(args, rows, complete=True)
    print(markdown(json.loads((REPO / args.out).read_text())))


def main(argv: list[str] | None = None) -> int:
    """CLI entry."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    # the lists are read here, so that a bad item stops the run before the dense evaluation, not after it
    p.add_argument("--keeps", type=comma_list(keep_ratio), default=[0.8], help="comma-separated")
    p.add_argument("--allocations", type=comma_list(one_of("uniform", "sensitivity", "sensitivity-normalised")),
                   default=["uniform"],
                   help="comma list of uniform, sensitivity (Fisher-weighted), sensitivity-normalised")
    p.add_argument("--latency-model", default="trn1", choices=["none", "trn1"], help="for sensitivity rows")
    p.add_argument("--rank-multiple", type=positive_int, default=32)
    p.add_argument("--calib-samples", type=positive_int, default=64, help="compression calibration windows (x 512)")
    p.add_argument("--steps", type=nonnegative_int, default=200, help="recovery steps; 0 skips recovery")
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seqlen", type=int_at_least(2), default=256)
    p.add_argument("--adapter-rank", type=positive_int, default=8)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--eval-seqlen", type=int_at_least(2), default=512)
    p.add_argument("--ppl", default="wikitext2,ptb,c4")
    p.add_argument("--ppl-limit", default="wikitext2=40,ptb=10,c4=10", help="windows per corpus (as neuronmm eval)")
    p.add_argument("--tasks", default="all")
    p.add_argument("--task-limit", type=positive_int, default=40)
    p.add_argument("--work-dir", default="/tmp/neuronmm-recovery-bench")
    p.add_argument("--reuse", action="store_true", help="reuse finished evals/recoveries in --work-dir")
    p.add_argument("--out", default="bench/results/recovery.json")
    args = p.parse_args(argv)
    check_out(REPO / args.out)  # _write puts it there after each row
    check_eval_lists(args.ppl, args.ppl_limit, args.tasks)  # the evals run after the recoveries
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
