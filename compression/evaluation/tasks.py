"""The seven zero-shot tasks as multiple-choice items, in lm-evaluation-harness's prompt formats.

Each item is a list of (context, continuation) log-likelihood requests, one per choice, the gold
index, and the choice strings whose character lengths `acc_norm` divides by. Formats follow the
harness's task YAMLs (target delimiter " " between context and choice):

- arc_easy / arc_challenge: "Question: {stem}\\nAnswer:" + " {choice}"; acc, acc_norm
- openbookqa: "{question_stem}" + " {choice}"; acc, acc_norm
- piqa: "Question: {goal}\\nAnswer:" + " {sol}"; acc, acc_norm
- boolq: "{passage}\\nQuestion: {question}?\\nAnswer:" + " no" / " yes"; acc
- hellaswag: "{activity_label}: {ctx}" + " {ending}", harness `preprocess` on both; acc, acc_norm
- winogrande: partial scoring, context "{sentence up to _}{option}" per option + " {rest}"; acc
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.config import data_file
from server.errors import ConfigError
from server.fileio import read_jsonl


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice question: a (context, continuation) request per choice and the gold index."""

    requests: tuple[tuple[str, str], ...]
    gold: int
    choice_texts: tuple[str, ...]  # what acc_norm measures the length of (no delimiter)


@dataclass(frozen=True)
class TaskSpec:
    """A task's loader and whether the harness reports acc_norm for it."""

    name: str
    load: Callable[[], list[MCItem]]
    has_acc_norm: bool


def _labels(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _choice_item(context: str, choices: list[str], gold: int) -> MCItem:
    return MCItem(tuple((context, " " + c) for c in choices), gold, tuple(choices))


def _ai2_items(path: Path, template: str) -> list[MCItem]:
    """ARC and OpenBookQA share the AI2 layout: question.stem, question.choices[], answerKey."""
    items = []
    for num, doc in read_jsonl(path):
        try:
            choices = doc["question"]["choices"]
            labels = [c["label"] for c in choices]
            gold = labels.index(doc["answerKey"].lstrip())
            items.append(_choice_item(template.format(doc["question"]["stem"]), [c["text"] for c in choices], gold))
        except (KeyError, ValueError, TypeError):
            raise ConfigError(f"{path}:{num}: not an AI2 multiple-choice record") from None
    return items


def arc_easy() -> list[MCItem]:
    """ARC-Easy test."""
    return _ai2_items(data_file("arc", "ARC-Easy-Test.jsonl"), "Question: {}\nAnswer:")


def arc_challenge() -> list[MCItem]:
    """ARC-Challenge test."""
    return _ai2_items(data_file("arc", "ARC-Challenge-Test.jsonl"), "Question: {}\nAnswer:")


def openbookqa() -> list[MCItem]:
    """OpenBookQA test: the bare question stem as context."""
    return _ai2_items(data_file("openbookqa", "test.jsonl"), "{}")


def piqa() -> list[MCItem]:
    """PIQA validation with its separate labels file."""
    path, label_path = data_file("piqa", "valid.jsonl"), data_file("piqa", "valid-labels.lst")
    docs, labels = list(read_jsonl(path)), _labels(label_path)
    if len(docs) != len(labels):
        raise ConfigError(f"{label_path}: {len(labels)} labels for {len(docs)} PIQA items")
    try:
        return [_choice_item(f"Question: {doc['goal']}\nAnswer:", [doc["sol1"], doc["sol2"]], int(label))
                for (_, doc), label in zip(docs, labels)]
    except (KeyError, ValueError):
        raise ConfigError(f"{path}: PIQA records need goal, sol1, sol2 and 0/1 labels") from None


def boolq() -> list[MCItem]:
    """BoolQ (SuperGLUE validation): choices " no" (0) and " yes" (1)."""
    path = data_file("boolq", "val.jsonl")
    items = []
    for num, doc in read_jsonl(path):
        label = str(doc.get("label", "")).lower()
        if label not in ("true", "false") or "passage" not in doc or "question" not in doc:
            raise ConfigError(f"{path}:{num}: BoolQ record needs passage, question and a true/false label")
        context = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
        items.append(_choice_item(context, ["no", "yes"], int(label == "true")))
    return items


def hellaswag_preprocess(text: str) -> str:
    """The harness's clean-up of WikiHow artefacts: " [title]" -> ". ", drop [tags], squeeze double spaces."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _capitalize_ctx_b(query: str) -> str:
    """Re-apply the harness's `ctx_b.capitalize()`, lost in llama.cpp's flattened file.

    ctx_b is the lower-cased fragment after the last sentence of ctx_a; when the text after the last
    ". " starts lower-case, it is that fragment.
    """
    head, sep, tail = query.rpartition(". ")
    if sep and tail[:1].islower():
        return head + sep + tail[0].upper() + tail[1:]
    return query


def hellaswag() -> list[MCItem]:
    """HellaSwag validation from llama.cpp's 6-lines-a-task file (context, gold, four endings)."""
    path = data_file("hellaswag", "hellaswag_val.txt")
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) % 6:
        raise ConfigError(f"{path}: {len(lines)} lines is not a multiple of 6")
    items = []
    for start in range(0, len(lines), 6):
        ctx, gold, *endings = lines[start:start + 6]
        if not gold.strip().isdigit() or not 0 <= int(gold) < 4:
            raise ConfigError(f"{path}:{start + 2}: gold index must be 0-3, got {gold!r}")
        query = _capitalize_ctx_b(hellaswag_preprocess(ctx))
        items.append(_choice_item(query, [hellaswag_preprocess(e) for e in endings], int(gold)))
    return items


def winogrande() -> list[MCItem]:
    """WinoGrande dev, partial scoring: each option completes the context, the shared rest is scored."""
    path, label_path = data_file("winogrande", "winogrande.llmfoundry.jsonl"), data_file("winogrande", "dev-labels.lst")
    docs, labels = list(read_jsonl(path)), _labels(label_path)
    if len(docs) != len(labels):
        raise ConfigError(f"{label_path}: {len(labels)} labels for {len(docs)} WinoGrande items")
    items = []
    for (num, doc), label in zip(docs, labels):
        try:
            options, rest, gold = doc["context_options"], doc["continuation"].strip(), int(doc["gold"])
        except (KeyError, ValueError, AttributeError):
            raise ConfigError(f"{path}:{num}: record needs context_options, continuation, gold") from None
        if len(options) != 2 or gold != int(label) - 1:
            raise ConfigError(f"{path}:{num}: needs two options and gold matching {label_path.name}")
        items.append(MCItem(tuple((opt, " " + rest) for opt in options), gold, tuple(options)))
    return items


TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("arc_easy", arc_easy, True),
    TaskSpec("arc_challenge", arc_challenge, True),
    TaskSpec("piqa", piqa, True),
    TaskSpec("hellaswag", hellaswag, True),
    TaskSpec("winogrande", winogrande, False),
    TaskSpec("boolq", boolq, False),
    TaskSpec("openbookqa", openbookqa, True),
)}


def get_task(name: str) -> TaskSpec:
    """A task by its lm-evaluation-harness name; unknown names are a one-line error."""
    if name not in TASKS:
        raise ConfigError(f"--tasks: unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[name]
