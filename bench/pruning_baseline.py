"""Structured pruning of the MLP intermediate dimension (blocks of 128) at the SVD default's budget (issue 18).

Loads the dense model as `neuronmm eval` does (compression.evaluation.model.load_eval_model, fp32, 2 threads),
computes the channel statistics once on the C4 calibration windows `neuronmm compress` uses (the config's
compression block: 64 x 512 tokens, seed 0), then for each variant prunes a copy in memory (nn.Linear modules
physically sliced, compression/prune.py) and runs the evaluation's perplexity protocol (512-token windows,
WikiText-2 40, PTB 10, C4 10 by default). No artifact is written. A variant is
`<uniform|global>-<energy|obs>[-fisher][+refit]`:

- energy: channel score E[h_j^2]·||down[:, j]||^2; obs: Optimal Brain Surgeon order with down_proj compensated
- fisher: per-layer costs weighted by the output Fisher of down_proj (the SVD sensitivity allocation's weight)
- refit: down_proj re-solved by least squares on the kept channels, layer by layer on the pruned activations

    nice -n 19 .venv/bin/python -m bench.pruning_baseline --out bench/results/pruning_baseline.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from bench.harness import (REPO, check_out, int_at_least, keep_ratio, machine_facts, nonnegative_float, nonnegative_int,
                           positive_int, run_cli, save_report)
from compression.calibration import compression_calibration
from compression.evaluation.cli import parse_ppl_limits
from compression.evaluation.corpora import CORPORA, corpus_text
from compression.evaluation.model import count_parameters, load_eval_model
from compression.evaluation.perplexity import perplexity
from compression.prune import apply_plan, budget_blocks, layer_stats, make_plan, mlp_parameters, removal_orders
from compression.sensitivity import output_fisher
from server.config import data_path, load_config
from server.errors import ConfigError
from server.models.artifact import weights_sha256

log = logging.getLogger("bench.pruning_baseline")

# The shipped SVD default (whitened, keep 0.8, multiple 128, greedy sensitivity), docs/BENCHMARKS.md, "Calibration
# without the C4 evaluation documents": quoted for comparison, not re-measured here.
SVD_DEFAULT = {"label": "SVD default (whitened, greedy sensitivity, quoted)", "mlp_params": 63_676_416, "seqlen": 512,
               "ppl": {"wikitext2": 68.78, "ptb": 147.09, "c4": 70.41}}  # calibrated without C4's eval split
DEFAULT_VARIANTS = ("uniform-energy,global-energy,global-energy-fisher,uniform-energy+refit,"
                    "global-energy-fisher+refit,global-obs-fisher+refit")


def parse_variant(name: str) -> dict:
    """`<uniform|global>-<energy|obs>[-fisher][+refit]` -> its settings."""
    base, plus, tail = name.partition("+")
    parts = base.split("-")
    if plus and tail != "refit" or len(parts) not in (2, 3) or parts[0] not in ("uniform", "global") \
            or parts[1] not in ("energy", "obs") or (len(parts) == 3 and parts[2] != "fisher"):
        raise ConfigError(f"--variants: cannot read {name!r} (expected <uniform|global>-<energy|obs>[-fisher][+refit])")
    return {"name": name, "allocation": parts[0], "score": parts[1], "fisher": len(parts) == 3, "refit": bool(plus)}


def _evaluate(model, tokenizer, texts: dict[str, str], limits: dict[str, int | None], seqlen: int) -> dict:
    out = {}
    for corpus, limit in limits.items():
        start = time.perf_counter()
        res = perplexity(model, tokenizer, corpus, texts[corpus], seqlen, limit, batch_size=4)
        out[corpus] = dict(res.to_dict(), wall_s=round(time.perf_counter() - start, 1))
        log.info("%s perplexity %.3f (%d windows)", corpus, res.perplexity, res.num_windows)
    return out


def _cell(row: dict, corpus: str) -> str:
    value = row.get("ppl", {}).get(corpus)
    return "–" if value is None else f"{value:.2f}"


def markdown(result: dict) -> str:
    """Results table (one row per method) and each pruned row's per-layer intermediate sizes."""
    mlp_dense = result["mlp_params_dense"]
    quoted = result["svd_default_quoted"]
    # the SVD numbers are quoted at their own window length: compared only with runs at that length
    svd = quoted["ppl"] if result.get("eval", {}).get("seqlen", 512) == quoted.get("seqlen", 512) else {}
    lines = ["| method | params (total) | MLP kept | WikiText-2 | PTB | C4 | vs SVD (W2 / PTB / C4) | prune s | eval s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        total = f"{row['params'] / 1e6:.2f} M" if row.get("params") else "–"
        kept = f"{100 * row['mlp_params'] / mlp_dense:.2f} %" if row.get("mlp_params") else "–"
        prune_s = f"{row['prune_wall_s']:.0f}" if row.get("prune_wall_s") is not None else "–"
        eval_s = f"{row['eval_wall_s']:.0f}" if row.get("eval_wall_s") is not None else "–"
        vs = " / ".join(f"{100 * (row['ppl'][c] / svd[c] - 1):+.1f} %" if c in row.get("ppl", {}) and c in svd
                        else "–" for c in CORPORA) if row.get("variant") and svd else "–"
        lines.append(f"| {row['label']} | {total} | {kept} | " + " | ".join(_cell(row, c) for c in CORPORA)
                     + f" | {vs} | {prune_s} | {eval_s} |")
    pre = result.get("prepass_wall_s", {})
    if pre:
        lines += ["", "Shared pre-pass (once for all rows, not in 'prune s'"
                  + (", read from the cache this run" if result.get("prepass_cached") else "") + "): "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in pre.items()) + "."]
    lines += ["", "Intermediate size per layer (layers 0..29):", ""]
    for row in result["rows"]:
        sizes = row.get("plan", {}).get("intermediate_sizes")
        if sizes:
            lines.append(f"- {row['label']}: " + " ".join(str(s) for s in sizes))
    return "\n".join(lines)


def _prepass(args, model, windows, bs: int, variants: list[dict], source_sha: str, result: dict) -> dict:
    """{"orders": {score: [RemovalOrder per layer]}, "fisher": [down_proj weight per layer] or absent}, read from
    --cache when its key (weights, calibration, settings) matches, else computed (and written there)."""
    scores = sorted({v["score"] for v in variants})
    want_fisher = any(v["fisher"] for v in variants)
    key = {"source_sha256": source_sha, "calibration": result["calibration"], "damp": args.damp,
           "most": model.config.intermediate_size - args.min_keep_blocks * args.block}
    cache = Path(args.cache) if args.cache else None
    found = torch.load(cache, weights_only=False) if cache and cache.is_file() else None
    if found is not None and found.get("key") != key:
        log.warning("%s was made with other weights or settings: recomputing the pre-pass", cache)
        found = None
    found = found or {"key": key, "orders": {}, "wall_s": {}}
    missing = [s for s in scores if s not in found["orders"]]
    if missing:
        t = time.perf_counter()
        stats = layer_stats(model, windows, bs)
        found["wall_s"]["channel statistics"] = round(time.perf_counter() - t, 1)
        for score in missing:
            t = time.perf_counter()
            found["orders"][score] = removal_orders(model, stats, score, key["most"], args.damp)
            found["wall_s"][f"{score} order"] = round(time.perf_counter() - t, 1)
        del stats
    computed = bool(missing)
    if want_fisher and "fisher" not in found:
        t = time.perf_counter()
        weights = output_fisher(model, windows[:args.fisher_windows])
        found["fisher"] = [weights[f"model.layers.{i}.mlp.down_proj"] for i in range(len(model.model.layers))]
        found["wall_s"]["output Fisher"] = round(time.perf_counter() - t, 1)
        computed = True
    if cache and computed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(found, cache)
    result["prepass_wall_s"] = dict(found["wall_s"])
    result["prepass_cached"] = not computed
    return found


def _write(args, result: dict, complete: bool) -> None:
    result["complete"] = complete
    save_report(REPO / args.out, result, markdown(result))


def check_budget(model_config, keep: float, block: int) -> None:
    """A ConfigError, before the dense evaluation and the pre-pass, where --keep or --block cannot make a plan for
    this model (compression.prune.budget_blocks's own rule: keep in (0, 1], the intermediate size a multiple of
    the block)."""
    try:
        budget_blocks(model_config.num_hidden_layers, model_config.hidden_size, model_config.intermediate_size, keep,
                      block)
    except ValueError as exc:
        raise ConfigError(f"--keep {keep} / --block {block}: {exc}") from None


def run(args) -> dict:
    """Pre-pass once, then prune + evaluate each variant; JSON (+ .md) after every row."""
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    cfg = load_config(args.config)
    comp = cfg.compression
    started = time.perf_counter()
    model, tokenizer, model_dir = load_eval_model(cfg, None, args.num_threads)
    check_budget(model.config, args.keep, args.block)
    limits = parse_ppl_limits(args.ppl_limit, None, list(CORPORA))
    texts = {c: corpus_text(c) for c in limits}
    mlp_dense = mlp_parameters(model)
    inter = model.config.intermediate_size
    hidden = model.config.hidden_size
    result = {**machine_facts(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs shared with other jobs (timings noisy), "
                         f"torch threads {torch.get_num_threads()}",
              "command": shlex.join([sys.executable, "-m", "bench.pruning_baseline", *sys.argv[1:]]),
              "model": cfg.model.name, "model_dir": str(model_dir),
              "eval": {"seqlen": args.seqlen, "ppl_windows": limits},
              "calibration": {"data": comp.calib_data, "samples": comp.calib_samples, "seqlen": comp.calib_seqlen,
                              "seed": comp.seed, "fisher_windows": args.fisher_windows,
                              "draw": "without the C4 evaluation documents"},
              "keep_ratio": args.keep, "block": args.block, "min_keep_blocks": args.min_keep_blocks,
              "refit_damp": args.damp, "mlp_params_dense": mlp_dense, "svd_default_quoted": SVD_DEFAULT,
              "prepass_wall_s": {}, "rows": []}
    rows = result["rows"]
    if not args.no_dense:
        start = time.perf_counter()
        ppl = _evaluate(model, tokenizer, texts, limits, args.seqlen)
        rows.append({"label": "dense", "params": count_parameters(model), "mlp_params": mlp_dense,
                     "ppl": {c: r["perplexity"] for c, r in ppl.items()}, "perplexity": ppl,
                     "eval_wall_s": round(time.perf_counter() - start, 1)})
        _write(args, result, complete=False)
    if args.seqlen == SVD_DEFAULT["seqlen"]:  # quoted numbers of another window length would not compare
        rows.append({"label": SVD_DEFAULT["label"], "mlp_params": SVD_DEFAULT["mlp_params"], "ppl": SVD_DEFAULT["ppl"],
                     "params": count_parameters(model) - mlp_dense + SVD_DEFAULT["mlp_params"], "quoted": True})

    calib = compression_calibration(data_path(comp.calib_data, "compression.calib_data"), tokenizer,
                                    comp.calib_samples, comp.calib_seqlen, comp.seed)
    windows = calib.windows
    bs = math.gcd(comp.calib_samples, args.batch_size)  # every calibration batch must have the same shape
    prepass = _prepass(args, model, windows, bs, variants, weights_sha256(model_dir), result)
    orders, fisher = prepass["orders"], prepass.get("fisher")
    if fisher is not None:
        result["fisher_down_proj"] = [float(f"{w:.6g}") for w in fisher]
    log.info("pre-pass done in %.0f s", time.perf_counter() - started)
    _write(args, result, complete=False)

    for v in variants:
        log.info("variant %s", v["name"])
        t = time.perf_counter()
        pruned = copy.deepcopy(model)
        plan = make_plan(orders[v["score"]], inter, hidden, args.keep, args.block, v["allocation"],
                         fisher if v["fisher"] else None, args.min_keep_blocks)
        refit = apply_plan(pruned, plan, windows, bs, refit=v["refit"], damp=args.damp)
        prune_s = time.perf_counter() - t
        t = time.perf_counter()
        ppl = _evaluate(pruned, tokenizer, texts, limits, args.seqlen)
        mlp_params = mlp_parameters(pruned)
        assert mlp_params == plan.record["mlp_params_used"] <= plan.record["mlp_budget"]
        rows.append({"label": f"prune {v['name']}", "variant": v, "params": count_parameters(pruned),
                     "mlp_params": mlp_params, "ppl": {c: r["perplexity"] for c, r in ppl.items()},
                     "perplexity": ppl, "plan": plan.record, "removed_blocks": plan.removed_blocks,
                     "refit": refit, "prune_wall_s": round(prune_s, 1),
                     "eval_wall_s": round(time.perf_counter() - t, 1)})
        del pruned
        _write(args, result, complete=False)
        print(markdown(result).split("\n\n")[0], flush=True)
    _write(args, result, complete=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--keep", type=keep_ratio, default=0.8, help="keep ratio of the MLP parameters (the budget)")
    p.add_argument("--block", type=positive_int, default=128, help="channels per block (trn1 tile)")
    p.add_argument("--min-keep-blocks", type=nonnegative_int, default=1, help="blocks every layer keeps at least")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--damp", type=nonnegative_float, default=1e-2,
                   help="ridge of the refit and the OBS order (x mean diag)")
    p.add_argument("--fisher-windows", type=positive_int, default=16)
    p.add_argument("--batch-size", type=positive_int, default=8, help="calibration windows per forward")
    p.add_argument("--seqlen", type=int_at_least(2), default=512)
    p.add_argument("--ppl-limit", default="wikitext2=40,ptb=10,c4=10")
    p.add_argument("--num-threads", type=positive_int, default=2)
    p.add_argument("--no-dense", action="store_true", help="skip the dense row")
    p.add_argument("--cache", default="/tmp/neuronmm-pruning/prepass.pt",
                   help="keeps the pre-pass (removal orders, Fisher) between runs; '' to disable")
    p.add_argument("--out", default="bench/results/pruning_baseline.json")
    args = p.parse_args(argv)
    check_out(REPO / args.out)  # _write puts it there after each row
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(args)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
