"""Evaluation results as a markdown table (the JSON goes through server.fileio.write_json_atomic)."""

from __future__ import annotations

_CORPUS_TITLES = {"wikitext2": "WikiText-2", "ptb": "PTB", "c4": "C4"}
TASK_TITLES = {"arc_easy": "ARC-E", "arc_challenge": "ARC-C", "piqa": "PIQA", "hellaswag": "HellaSwag",
                "winogrande": "WinoGrande", "boolq": "BoolQ", "openbookqa": "OBQA"}


def mean_accuracy(zeroshot: dict[str, dict]) -> float | None:
    """Unweighted mean of `acc` over the tasks run (None when none ran)."""
    accs = [r["acc"] for r in zeroshot.values()]
    return sum(accs) / len(accs) if accs else None


def _fmt_ppl(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"


def _fmt_task(result: dict | None) -> str:
    if result is None:
        return "–"
    cell = f"{100 * result['acc']:.1f}"
    if result.get("acc_norm") is not None:
        cell += f" / {100 * result['acc_norm']:.1f}"
    return cell


def markdown_table(runs: list[dict]) -> str:
    """One row per run (each a `neuronmm eval` result dict with a `label`); columns for what any run has."""
    corpora = [c for c in _CORPUS_TITLES if any(c in r.get("perplexity", {}) for r in runs)]
    tasks = [t for t in TASK_TITLES if any(t in r.get("zeroshot", {}) for r in runs)]
    head = ["model", "params"] + [f"{_CORPUS_TITLES[c]} ppl" for c in corpora] + [TASK_TITLES[t] for t in tasks]
    if tasks:
        head.append("mean acc")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        ppl, zs = run.get("perplexity", {}), run.get("zeroshot", {})
        row = [run.get("label", "?"), f"{run.get('num_parameters', 0) / 1e6:.1f} M"]
        row += [_fmt_ppl(ppl.get(c, {}).get("perplexity")) for c in corpora]
        row += [_fmt_task(zs.get(t)) for t in tasks]
        if tasks:
            mean = mean_accuracy(zs)
            row.append("–" if mean is None else f"{100 * mean:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def table_legend(runs: list[dict]) -> str:
    """The line under a table: windows, items and what the accuracy cells hold."""
    run = runs[0] if runs else {}
    ppl = run.get("perplexity", {})
    tasks = run.get("zeroshot", {})
    zs = next(iter(tasks.values()), None)
    parts = []
    if ppl:
        windows = ", ".join(f"{_CORPUS_TITLES[c]} {r['num_windows']}" for c, r in ppl.items())
        seqlen = next(iter(ppl.values()))["seqlen"]
        parts.append(f"perplexity over non-overlapping windows of {seqlen} tokens ({windows} windows)")
    if zs:
        counts = ", ".join(f"{r['num_items']}" for r in tasks.values())
        parts.append(f"zero-shot items per task {counts} (the first items of each split; a task's whole split when "
                     "no limit was given), cells are acc % / acc_norm % (acc only where the harness reports only acc); "
                     "mean acc is the unweighted mean of acc")
    return "; ".join(parts) + "." if parts else ""
