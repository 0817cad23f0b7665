"""Zero-shot multiple choice scored the lm-evaluation-harness way: log-likelihood of each continuation.

Tokenization follows the harness's HF model: trailing spaces of the context move to the
continuation, the continuation's tokens are those of `context + continuation` after the context's
own tokens, no special tokens. `acc` picks the highest log-likelihood, `acc_norm` the highest
log-likelihood per character of the choice string.

Speed: when all choices share the context (every task but WinoGrande), the context runs once and
its KV cache is repeated for the choices; the first continuation token is scored from the
context's last logits, so single-token choices (BoolQ) cost one forward per item.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from compression.evaluation.tasks import MCItem, TaskSpec


@dataclass(frozen=True)
class TaskResult:
    """Accuracy of one task over `num_items` items (acc_norm None where the harness does not report it)."""

    task: str
    num_items: int
    acc: float
    acc_stderr: float
    acc_norm: float | None
    acc_norm_stderr: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def encode_pair(tokenizer, context: str, continuation: str, max_len: int = 2048) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the harness splits them; context left-truncated to fit max_len."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    if not ctx:  # the harness conditions an empty context on the end-of-text token
        ctx = [tokenizer.eos_token_id]
    if not cont:
        raise ValueError(f"continuation {continuation!r} tokenizes to nothing")
    keep = max(1, max_len - len(cont) + 1)
    return ctx[-keep:], cont


def _pad_right(rows: list[list[int]], pad: int) -> torch.Tensor:
    # Right padding needs no attention mask under causal attention: real tokens never see the pads.
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def _shared_context_lls(model, ctx: list[int], conts: list[list[int]]) -> list[float]:
    out = model(input_ids=torch.tensor([ctx]), use_cache=True, logits_to_keep=1)
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    lls = [float(first[c[0]]) for c in conts]
    longer = [i for i, c in enumerate(conts) if len(c) > 1]
    if longer:
        cache = out.past_key_values
        cache.batch_repeat_interleave(len(longer))
        inp = _pad_right([conts[i][:-1] for i in longer], pad=ctx[-1])
        logp = torch.log_softmax(model(input_ids=inp, past_key_values=cache).logits.float(), dim=-1)
        for row, i in enumerate(longer):
            target = torch.tensor(conts[i][1:])
            lls[i] += float(logp[row, torch.arange(len(target)), target].sum())
    return lls


def _separate_context_lls(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    rows = [(ctx + cont)[:-1] for ctx, cont in pairs]
    logits = model(input_ids=_pad_right(rows, pad=rows[0][-1]), use_cache=False).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    lls = []
    for row, (ctx, cont) in enumerate(pairs):
        pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
        lls.append(float(logp[row, pos, torch.tensor(cont)].sum()))
    return lls


@torch.inference_mode()
def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Sum of log p(continuation | context) per (context ids, continuation ids) pair, one batched pass per item."""
    contexts = {tuple(ctx) for ctx, _ in pairs}
    if len(contexts) == 1:
        return _shared_context_lls(model, pairs[0][0], [cont for _, cont in pairs])
    return _separate_context_lls(model, pairs)


def predictions(lls: list[float], choice_texts: tuple[str, ...]) -> tuple[int, int]:
    """(acc prediction, acc_norm prediction): argmax of log-likelihood, and of it per character."""
    pred = max(range(len(lls)), key=lambda i: lls[i])
    pred_norm = max(range(len(lls)), key=lambda i: lls[i] / max(1, len(choice_texts[i])))
    return pred, pred_norm


def _stderr(hits: int, n: int) -> float:
    # Sample standard error of the mean of 0/1 outcomes, as the harness reports it.
    if n < 2:
        return float("nan")
    p = hits / n
    return math.sqrt(p * (1 - p) / (n - 1))


def score_items(model, tokenizer, items: list[MCItem], desc: str = "items") -> tuple[int, int]:
    """(acc hits, acc_norm hits) over items."""
    hits = hits_norm = 0
    for item in tqdm(items, desc=desc, unit="item"):
        pairs = [encode_pair(tokenizer, ctx, cont) for ctx, cont in item.requests]
        pred, pred_norm = predictions(loglikelihoods(model, pairs), item.choice_texts)
        hits += pred == item.gold
        hits_norm += pred_norm == item.gold
    return hits, hits_norm


def evaluate_task(model, tokenizer, spec: TaskSpec, limit: int | None = None) -> TaskResult:
    """Zero-shot accuracy of one task on its first `limit` items (all when None)."""
    items = spec.load()
    if limit is not None:
        items = items[:limit]
    hits, hits_norm = score_items(model, tokenizer, items, desc=spec.name)
    n = len(items)
    norm = (hits_norm / n, _stderr(hits_norm, n)) if spec.has_acc_norm else (None, None)
    return TaskResult(spec.name, n, hits / n, _stderr(hits, n), *norm)
