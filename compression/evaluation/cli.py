"""`neuronmm eval`: perplexity and zero-shot accuracy of the dense model or a compressed artifact."""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import time
from pathlib import Path

import torch

from compression.evaluation.corpora import CORPORA, corpus_text
from compression.evaluation.model import count_parameters, load_eval_model, max_positions
from compression.evaluation.perplexity import perplexity
from compression.evaluation.report import markdown_table, mean_accuracy, table_legend
from compression.evaluation.tasks import TASKS, get_task
from compression.evaluation.zeroshot import evaluate_task
from server.config import load_config
from server.errors import ConfigError
from server.fileio import atomic_file, check_out_file, write_json_atomic
from server.models.artifact import read_manifest
from server.models.int8_linear import quantize_linears_ref

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` subcommand."""
    p = subparsers.add_parser("eval", help="perplexity (WikiText-2, PTB, C4) and zero-shot accuracy (7 tasks)")
    p.add_argument("--config", help="YAML config (default: configs/smollm2-135m.yaml)")
    p.add_argument("--compressed", help="a compressed artifact directory (manifest.json + factors)")
    p.add_argument("--quantization", choices=["int8"],
                   help="int8: every linear as the served int8 panel GEMM computes it (int8 weights per output column, "
                        "activations per 64 inputs), in plain torch")
    p.add_argument("--tasks", default="all",
                   help="comma list of arc_easy,arc_challenge,piqa,hellaswag,winogrande,boolq,openbookqa; "
                        "'all' or 'none' (default all)")
    p.add_argument("--ppl", default="wikitext2,ptb,c4", help="comma list of wikitext2,ptb,c4, or 'none'")
    p.add_argument("--seqlen", default="2048", help="perplexity window length (2048 as in the papers; 512 for speed)")
    p.add_argument("--limit", help="at most N perplexity windows per corpus and N items per task")
    p.add_argument("--ppl-limit", help="at most N windows per corpus, or per corpus as wikitext2=40,ptb=10 "
                                       "(overrides --limit for perplexity)")
    p.add_argument("--task-limit", help="at most N items per task (overrides --limit for zero-shot)")
    p.add_argument("--batch-size", default="4", help="windows per forward pass for perplexity")
    p.add_argument("--num-threads", default="2", help="torch threads (at most 2: the CPU is shared)")
    p.add_argument("--label", help="row label in the table (default: 'dense' or the artifact folder name)")
    p.add_argument("--out", help="write results JSON here (and the markdown table beside it, .md)")
    p.set_defaults(func=run_eval)


def positive_int(flag: str, value: str | None) -> int | None:
    """A CLI integer that must be >= 1; anything else is a one-line ConfigError naming the flag."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{flag}: expected a positive integer, got {value!r}") from None
    if number < 1:
        raise ConfigError(f"{flag}: expected a positive integer, got {value!r}")
    return number


def parse_list(flag: str, value: str, allowed: tuple[str, ...], all_word: str | None = None) -> list[str]:
    """Comma-separated names checked against `allowed`; 'none' is empty, `all_word` is everything."""
    value = value.strip()
    if value == "none":
        return []
    if all_word and value == all_word:
        return list(allowed)
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ConfigError(f"{flag}: empty list (use 'none' to skip)")
    for name in names:
        if name not in allowed:
            raise ConfigError(f"{flag}: unknown name {name!r} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(names))


def parse_ppl_limits(value: str | None, default: int | None, corpora: list[str]) -> dict[str, int | None]:
    """Window limit per corpus from "N" or "corpus=N,..." (corpora not named keep `default`)."""
    limits = dict.fromkeys(corpora, default)
    if value is None:
        return limits
    if "=" not in value:
        return dict.fromkeys(corpora, positive_int("--ppl-limit", value))
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name.strip() not in limits:
            raise ConfigError(f"--ppl-limit: {name.strip()!r} is not among the --ppl corpora")
        limits[name.strip()] = positive_int("--ppl-limit", number)
    return limits


def check_eval_lists(ppl: str, ppl_limit: str | None, tasks: str) -> None:
    """ConfigError (one line) when `neuronmm eval` would refuse these --ppl, --ppl-limit and --tasks values: lets
    a caller that runs the eval later (after a compression) stop before its work."""
    parse_list("--tasks", tasks, tuple(TASKS), all_word="all")
    parse_ppl_limits(ppl_limit, None, parse_list("--ppl", ppl, CORPORA))


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate and print the markdown table; JSON to --out."""
    tasks = parse_list("--tasks", args.tasks, tuple(TASKS), all_word="all")
    corpora = parse_list("--ppl", args.ppl, CORPORA)
    seqlen = positive_int("--seqlen", args.seqlen)
    if seqlen < 16:
        raise ConfigError(f"--seqlen: at least 16 tokens, got {seqlen}")
    limit = positive_int("--limit", args.limit)
    ppl_limits = parse_ppl_limits(args.ppl_limit, limit, corpora)
    task_limit = positive_int("--task-limit", args.task_limit) or limit
    batch_size = positive_int("--batch-size", args.batch_size)
    threads = positive_int("--num-threads", args.num_threads)
    if not tasks and not corpora:
        raise ConfigError("nothing to evaluate: --tasks none and --ppl none")
    if args.compressed and not Path(args.compressed).expanduser().is_dir():
        raise ConfigError(f"--compressed: not a directory: {args.compressed}")

    out = results_paths(Path(args.out)) if args.out else None  # checked before the (minutes-long) evaluation
    cfg = load_config(args.config)
    manifest = read_manifest(Path(args.compressed)).to_dict() if args.compressed else None
    result = evaluate(cfg, args.compressed, tasks, ppl_limits, seqlen, task_limit, batch_size, threads,
                      args.quantization)
    label = Path(args.compressed).name if args.compressed else "dense"
    result["label"] = args.label or (f"{label}, {args.quantization}" if args.quantization else label)
    result["manifest"] = manifest
    table = markdown_table([result]) + "\n\n" + table_legend([result]) + "\n"
    print(table)
    if out:
        json_path, md_path = out
        write_json_atomic(json_path, result)
        with atomic_file(md_path) as tmp:
            tmp.write_text(table)
        log.info("results written to %s and %s", json_path, md_path)
    return 0


def results_paths(out: Path) -> tuple[Path, Path]:
    """Where --out puts the results' JSON and their markdown table (beside it, .md), both checked writable: an --out
    that names the .md itself gets its JSON beside it rather than overwritten by the table."""
    json_path = out.with_suffix(".json") if out.suffix == ".md" else out
    return check_out_file(json_path, "--out"), check_out_file(json_path.with_suffix(".md"), "--out")


def evaluate(cfg, compressed: str | None, tasks: list[str], ppl_limits: dict[str, int | None], seqlen: int,
             task_limit: int | None, batch_size: int = 4, num_threads: int = 2, quantization: str | None = None) -> dict:
    """The result dict of one evaluation (perplexities per corpus with its window limit, task accuracies)."""
    if ppl_limits and seqlen > (positions := max_positions(cfg)):
        raise ConfigError(f"--seqlen: {seqlen} exceeds the model's {positions} positions")
    model, tokenizer, model_dir = load_eval_model(cfg, compressed, num_threads)
    if quantization:
        log.info("int8 (reference) weights in %d linear layers", quantize_linears_ref(model))
    result = {"model": cfg.model.name, "model_dir": str(model_dir), "compressed": compressed,
              "quantization": quantization,
              "num_parameters": count_parameters(model), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "torch_threads": torch.get_num_threads(), "perplexity": {}, "zeroshot": {}, "seconds": {}}
    for name, limit in ppl_limits.items():
        start = time.perf_counter()
        res = perplexity(model, tokenizer, name, corpus_text(name), seqlen, limit, batch_size)
        result["perplexity"][name] = res.to_dict()
        result["seconds"][f"ppl_{name}"] = round(time.perf_counter() - start, 1)
        log.info("%s perplexity %.3f over %d windows of %d", name, res.perplexity, res.num_windows, seqlen)
    for name in tasks:
        start = time.perf_counter()
        res = evaluate_task(model, tokenizer, get_task(name), task_limit)
        result["zeroshot"][name] = res.to_dict()
        result["seconds"][name] = round(time.perf_counter() - start, 1)
        log.info("%s acc %.3f (n=%d)", name, res.acc, res.num_items)
    result["zeroshot_mean_acc"] = mean_accuracy(result["zeroshot"])
    return result
