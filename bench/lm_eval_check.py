"""lm-evaluation-harness against the server: lm-eval's `local-completions` model vs `neuronmm eval`, same items.

Starts `neuronmm serve` on the default model (fp32 by default, the dtype `neuronmm eval` scores in), runs
lm-eval (from PyPI) with its `local-completions` model on bench/lm_eval_tasks/arc_easy_local.yaml (ARC-Easy
from ../shared/data, the harness's own prompt) over the first --limit items, then scores the same items
with neuronmm eval's zero-shot code (compression/evaluation, transformers in fp32). Both compute each
choice's log-likelihood, lm-eval through the server's echoed prompt logprobs; the report gives both
accuracies, the items whose prediction differs and the largest per-choice log-likelihood difference.

    python -m bench.lm_eval_check --limit 100
    python -m bench.lm_eval_check --limit 100 --dtype auto      # the server as it serves by default (bf16 here)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / datasets read it
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import yaml  # noqa: E402

from bench.harness import (MODEL_DTYPES, ServerProcess, check_out, machine_facts, positive_int, run_cli,  # noqa: E402
                           save_report, tcp_port, write_config)
from compression.evaluation.model import load_eval_model  # noqa: E402
from compression.evaluation.tasks import get_task  # noqa: E402
from compression.evaluation.zeroshot import encode_pair, loglikelihoods, predictions  # noqa: E402
from server.config import data_file, load_config  # noqa: E402
from server.errors import ConfigError  # noqa: E402
from server.models.source import resolve_model_dir  # noqa: E402

log = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results"
TASK_YAML = Path(__file__).parent / "lm_eval_tasks" / "arc_easy_local.yaml"
TASK = "arc_easy_local"


def lm_eval_module():
    """lm-eval, imported on first use: it is an extra (`bench`), and --help or a bad flag need not have it."""
    try:
        return importlib.import_module("lm_eval")
    except ModuleNotFoundError as exc:
        if exc.name != "lm_eval":  # lm-eval is there but broken: its own error says more
            raise
        raise ConfigError("lm-eval is not installed: pip install -e '.[bench]'") from None


def write_task(folder: Path) -> Path:
    """The task YAML with its data file resolved (NEURONMM_DATA_DIR or ../shared/data), in `folder`."""
    spec = yaml.safe_load(TASK_YAML.read_text())
    spec["dataset_kwargs"]["data_files"]["test"] = str(data_file("arc", "ARC-Easy-Test.jsonl"))
    path = folder / TASK_YAML.name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_lm_eval(base_url: str, model: str, tokenizer_dir: Path, task_dir: Path, limit: int,
                batch_size: int) -> dict:
    """lm-eval's local-completions on the task: {"acc", "acc_norm", "lls": per item, per choice}."""
    lm_eval = lm_eval_module()
    task_manager = importlib.import_module("lm_eval.tasks").TaskManager(include_path=str(task_dir))
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{base_url}/v1/completions", "model": model, "tokenizer": str(tokenizer_dir),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                    "max_retries": 1, "batch_size": batch_size},
        tasks=[TASK], task_manager=task_manager, limit=limit, log_samples=True,
        num_fewshot=0)
    metrics = out["results"][TASK]
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [[float(resp[0]) for resp in s["filtered_resps"]] for s in samples]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "lls": lls}


def run_neuronmm_eval(limit: int) -> dict:
    """neuronmm eval's zero-shot scoring of the same items: {"acc", "acc_norm", "lls"}."""
    model, tokenizer, _ = load_eval_model(load_config())
    items = get_task("arc_easy").load()[:limit]
    lls, hits, hits_norm = [], 0, 0
    for item in items:
        item_lls = loglikelihoods(model, [encode_pair(tokenizer, ctx, cont) for ctx, cont in item.requests])
        pred, pred_norm = predictions(item_lls, item.choice_texts)
        hits += pred == item.gold
        hits_norm += pred_norm == item.gold
        lls.append(item_lls)
    return {"acc": hits / len(items), "acc_norm": hits_norm / len(items), "lls": lls, "golds": [i.gold for i in items],
            "choice_texts": [i.choice_texts for i in items]}


def compare(harness: dict, ours: dict) -> dict:
    """Items whose acc / acc_norm prediction differs, and the largest per-choice log-likelihood gap."""
    if len(harness["lls"]) != len(ours["lls"]):
        raise RuntimeError(f"lm-eval scored {len(harness['lls'])} items, neuronmm eval {len(ours['lls'])}")
    differ, differ_norm, gap = [], [], 0.0
    for i, (theirs, mine, texts) in enumerate(zip(harness["lls"], ours["lls"], ours["choice_texts"])):
        if len(theirs) != len(mine):
            raise RuntimeError(f"item {i}: {len(theirs)} choices in lm-eval, {len(mine)} in neuronmm eval")
        gap = max(gap, *(abs(a - b) for a, b in zip(theirs, mine)))
        (p1, n1), (p2, n2) = predictions(theirs, texts), predictions(mine, texts)
        if p1 != p2:
            differ.append(i)
        if n1 != n2:
            differ_norm.append(i)
    return {"items_acc_differ": differ, "items_acc_norm_differ": differ_norm, "max_abs_loglik_diff": gap}


def markdown(report: dict) -> str:
    h, o, c = report["lm_eval"], report["neuronmm_eval"], report["comparison"]
    return "\n".join([
        f"ARC-Easy, first {report['limit']} test items, zero-shot; server dtype {report['server_dtype']}",
        "",
        "| scorer | acc | acc_norm | seconds |",
        "|---|---|---|---|",
        f"| lm-eval {report['lm_eval_version']} local-completions -> neuronmm serve | {h['acc']:.4f} | "
        f"{h['acc_norm']:.4f} | {report['seconds']['lm_eval']:.0f} |",
        f"| neuronmm eval (transformers fp32) | {o['acc']:.4f} | {o['acc_norm']:.4f} | "
        f"{report['seconds']['neuronmm_eval']:.0f} |",
        "",
        f"Items whose prediction differs: acc {len(c['items_acc_differ'])}, acc_norm "
        f"{len(c['items_acc_norm_differ'])}; largest per-choice log-likelihood difference "
        f"{c['max_abs_loglik_diff']:.2e} nats.",
        ""])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.lm_eval_check", description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=positive_int, default=100, help="first N ARC-Easy test items")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="float32",
                   help="server dtype (float32 matches neuronmm eval; auto: default)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts per lm-eval request")
    p.add_argument("--port", type=tcp_port, default=8310, help="port for the server this starts")
    p.add_argument("--out", default=str(RESULTS / "lm_eval_check.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = check_out(args.out)
    lm_eval = lm_eval_module()  # before the server starts: a missing extra is one line, not a traceback later
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config()
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = Path(tmp)
        write_task(task_dir)
        config = write_config(task_dir / "serve.yaml", None, model={"dtype": args.dtype})
        with ServerProcess(config, RESULTS / "lm_eval_check-server.log", port=args.port) as server:
            server.wait_ready()
            start = time.monotonic()
            harness = run_lm_eval(server.url, cfg.model.name, model_dir, task_dir, args.limit, args.batch_size)
            lm_eval_s = time.monotonic() - start
    start = time.monotonic()
    ours = run_neuronmm_eval(args.limit)
    ours_s = time.monotonic() - start
    report = {
        "command": " ".join(["python -m bench.lm_eval_check", *(argv if argv is not None else sys.argv[1:])]),
        **machine_facts(), "limit": args.limit, "server_dtype": args.dtype, "lm_eval_version": lm_eval.__version__,
        "lm_eval": {k: harness[k] for k in ("acc", "acc_norm")},
        "neuronmm_eval": {k: ours[k] for k in ("acc", "acc_norm")},
        "comparison": compare(harness, ours), "seconds": {"lm_eval": lm_eval_s, "neuronmm_eval": ours_s},
        "lls": {"lm_eval": harness["lls"], "neuronmm_eval": ours["lls"]},
    }
    save_report(out, report, markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
