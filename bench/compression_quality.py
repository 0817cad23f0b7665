"""Quality of MLP-only SVD compression on the default model: dense vs plain vs whitened, two rank multiples.

For each (rank multiple, method, keep ratio) it runs `neuronmm compress` in a subprocess (wall time and
peak RSS of that process recorded), reads the manifest (ranks, parameter counts), then `neuronmm eval`
on the artifact. Artifacts whose factor files are byte-identical (e.g. keep 0.9 and 0.8 both round
to rank 384 at multiple 128) are evaluated once. Writes JSON and a markdown table.

    .venv/bin/python -m bench.compression_quality --out bench/results/compression_quality.json
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

from bench.harness import (NEURONMM, REPO, check_out, comma_list, int_at_least, keep_ratio, machine_facts, one_of,
                           positive_int, run_cli, run_logged, save_report)
from compression.evaluation.cli import check_eval_lists
from compression.evaluation.report import TASK_TITLES, mean_accuracy
from compression.rank import block_rank, saves_parameters
from server.fileio import files_sha256
from server.models.artifact import MANIFEST, Manifest, read_manifest


def manifest_facts(manifest: Manifest) -> dict:
    """Ranks per MLP projection kind and whole-model parameter counts, from an artifact manifest."""
    ranks: dict[str, set] = {}
    for name, info in manifest.modules.items():
        ranks.setdefault(name.rsplit(".", 1)[-1], set()).add("dense" if info.dense else info.rank)
    before, after = manifest.params_before, manifest.params_after
    return {"ranks": {k: sorted(v, key=str) for k, v in sorted(ranks.items())},
            "params_before": before, "params_after": after,
            "param_ratio": (after / before) if before and after else None}


def _same_rank_artifact(work: Path, method: str, keep: float, multiple: int, allocation: str) -> Path | None:
    """An artifact already in work with this method whose every rank equals what (keep, multiple) gives.

    Only the uniform allocation's ranks are known before compressing; the sensitivity allocation's come out of it.
    """
    if allocation != "uniform":
        return None
    for manifest_path in sorted(work.glob(f"{method}-k*-m*/{MANIFEST}")):
        modules = read_manifest(manifest_path.parent).modules
        if modules and all(
                info.rank == block_rank(info.in_features, info.out_features, keep, multiple) if not info.dense else
                not saves_parameters(info.in_features, info.out_features,
                                     block_rank(info.in_features, info.out_features, keep, multiple))
                for info in modules.values()):
            return manifest_path.parent
    return None


def _eval_cmd(args, out: Path, label: str, compressed: Path | None) -> list[str]:
    cmd = NEURONMM + ["eval", "--config", args.config, "--seqlen", str(args.seqlen), "--ppl", args.ppl,
                      "--tasks", args.tasks, "--task-limit", str(args.task_limit), "--num-threads",
                      str(args.num_threads), "--label", label, "--out", str(out)]
    cmd += ["--ppl-limit", str(args.ppl_limit)]
    if compressed:
        cmd += ["--compressed", str(compressed)]
    return cmd


def _evaluate(args, work: Path, label: str, compressed: Path | None) -> dict:
    out = work / f"eval-{label}.json"
    if not (args.reuse and out.is_file()):
        wall, _ = run_logged(_eval_cmd(args, out, label, compressed), work / f"eval-{label}.log")
        print(f"  eval {label}: {wall:.0f} s", flush=True)
    return json.loads(out.read_text())


def _settings(args) -> list[tuple[int, str, float]]:
    return [(m, method, k) for m in args.multiples for method in args.methods for k in args.keeps]


def _header(args) -> dict:
    return {**machine_facts(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch threads {args.num_threads}",
            "limits": {"seqlen": args.seqlen, "ppl_windows": args.ppl_limit, "task_items": args.task_limit},
            "command": shlex.join([sys.executable, "-m", "bench.compression_quality", *sys.argv[1:]])}


def _checkpoint(args, rows: list[dict], complete: bool) -> dict:
    """Write what is done so far (so an interrupted run still leaves its finished rows)."""
    result = dict(_header(args), complete=complete, rows=rows)
    save_report(REPO / args.out, result, markdown(result))
    return result


def run(args) -> dict:
    """Compress and evaluate every setting; the result dict, also written as JSON after each row."""
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = [dict(_evaluate(args, work, "dense", None), setting={"method": "dense"})]
    evaluated: dict[str, dict] = {}
    for multiple, method, keep in _settings(args):
        label = f"{method}-k{keep}-m{multiple}" + ("" if args.allocation == "uniform" else f"-{args.allocation}")
        artifact = work / label
        setting = {"method": method, "keep_ratio": keep, "rank_multiple": multiple, "allocation": args.allocation}
        twin = _same_rank_artifact(work, method, keep, multiple, args.allocation)
        if twin is not None and not (artifact / MANIFEST).is_file():
            # Same method, calibration and ranks => identical factors: reuse instead of recompressing.
            print(f"  {label}: same ranks as {twin.name}, reusing it", flush=True)
            artifact = twin
        elif not (args.reuse and (artifact / MANIFEST).is_file()):
            cmd = NEURONMM + ["compress", "--config", args.config, "--keep-ratio", str(keep), "--method", method,
                              "--targets", "mlp", "--rank-multiple", str(multiple), "--allocation", args.allocation,
                              "--out", str(artifact)]
            wall, peak = run_logged(cmd, work / f"compress-{label}.log")
            (work / f"compress-{label}.time.json").write_text(json.dumps({"wall_s": wall, "peak_rss_mib": peak}))
        timing = json.loads((work / f"compress-{artifact.name}.time.json").read_text())
        setting.update(compress_wall_s=round(timing["wall_s"], 1), compress_peak_rss_mib=round(timing["peak_rss_mib"]))
        setting.update(manifest_facts(read_manifest(artifact)))
        digest = files_sha256(artifact.glob("*.safetensors"))
        if digest in evaluated:
            result = dict(evaluated[digest], label=label)
            setting["same_factors_as"] = evaluated[digest]["label"]
        else:
            result = _evaluate(args, work, label, artifact)
            evaluated[digest] = result
        print(f"  {label}: ranks {setting['ranks']} ratio {setting['param_ratio']}", flush=True)
        rows.append(dict(result, setting=setting))
        _checkpoint(args, rows, complete=False)
    return _checkpoint(args, rows, complete=True)


def _cell_ppl(row: dict, corpus: str) -> str:
    value = row.get("perplexity", {}).get(corpus, {}).get("perplexity")
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def markdown(result: dict) -> str:
    """The results table: one row per setting."""
    tasks = [t for t in TASK_TITLES if any(t in r.get("zeroshot", {}) for r in result["rows"])]
    head = ["method", "keep", "mult", "ranks gate/up/down", "params", "compress s / MiB",
            "Wiki2", "PTB", "C4"] + [TASK_TITLES[t] for t in tasks] + ["mean acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        s = row["setting"]
        ranks = s.get("ranks", {})
        rank_cell = "/".join(",".join(map(str, ranks.get(k, ["?"]))) for k in ("gate_proj", "up_proj", "down_proj"))
        ratio = s.get("param_ratio")
        params = f"{row['num_parameters'] / 1e6:.1f} M" + (f" ({100 * ratio:.1f} %)" if ratio else "")
        comp = f"{s['compress_wall_s']:.0f} / {s['compress_peak_rss_mib']:.0f}" if "compress_wall_s" in s else "–"
        cells = [s["method"], str(s.get("keep_ratio", "–")), str(s.get("rank_multiple", "–")),
                 rank_cell if ranks else "–", params, comp] + [_cell_ppl(row, c) for c in ("wikitext2", "ptb", "c4")]
        for t in tasks:
            r = row.get("zeroshot", {}).get(t)
            cells.append("–" if r is None else f"{100 * r['acc']:.1f}" + (
                f" / {100 * r['acc_norm']:.1f}" if r.get("acc_norm") is not None else ""))
        mean = mean_accuracy(row.get("zeroshot", {}))
        cells.append("–" if mean is None else f"{100 * mean:.1f}")
        if s.get("same_factors_as"):
            cells[0] += "*"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run all settings, write JSON + markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    # the lists are read here, so that a bad item stops the run before the dense evaluation, not after it
    p.add_argument("--keeps", type=comma_list(keep_ratio), default=[0.9, 0.8, 0.6], help="comma-separated")
    p.add_argument("--methods", type=comma_list(one_of("whitened", "plain")), default=["whitened", "plain"],
                   help="comma-separated")
    p.add_argument("--multiples", type=comma_list(positive_int), default=[128, 32], help="comma-separated")
    p.add_argument("--allocation", choices=("uniform", "sensitivity"), default="uniform",
                   help="rank allocation of every compression (uniform: the published tables' protocol; sensitivity: "
                        "the product's default)")
    p.add_argument("--seqlen", type=int_at_least(2), default=512)
    p.add_argument("--ppl", default="wikitext2,ptb,c4")
    p.add_argument("--ppl-limit", default="wikitext2=40,ptb=10,c4=10")
    p.add_argument("--tasks", default="all")
    p.add_argument("--task-limit", type=positive_int, default=40)
    p.add_argument("--num-threads", type=positive_int, default=1)
    p.add_argument("--work-dir", default="/tmp/neuronmm-compression-quality")
    p.add_argument("--reuse", action="store_true", help="reuse artifacts and eval JSON already in --work-dir")
    p.add_argument("--out", default="bench/results/compression_quality.json")
    args = p.parse_args(argv)
    check_out(REPO / args.out)  # _checkpoint writes it there after each row
    check_eval_lists(args.ppl, args.ppl_limit, args.tasks)  # the eval runs after the compressions
    print(markdown(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
