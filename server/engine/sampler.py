"""Batched token selection with per-sequence temperature, top-k, top-p, penalties, seeds and logprobs."""

from __future__ import annotations

import torch

from server.engine.logits_processors import apply_logits_processors
from server.engine.sequence import Sequence, TokenLogprob


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over each sequence's generated tokens (in place)."""
    for row, seq in enumerate(seqs):
        params = seq.params
        if not params.has_penalties or not seq.output_ids:
            continue
        ids = torch.tensor(seq.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [vocab] outside the top-k set and outside the smallest top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


# Sorting the whole vocabulary per sequence dominated sampling (49k entries, ~4 ms a row). The nucleus
# and the top-k set usually sit inside the few hundred most likely tokens, so sample among those when
# that is provably the same distribution, and fall back to the full sort when it is not.
_NUM_CANDIDATES = 256


def _sample_candidates(scaled: torch.Tensor, top_k: int, top_p: float,
                       generator: torch.Generator | None) -> int | None:
    """Exact top-k/top-p sampling from the leading candidates of `scaled` [vocab]; None if they do not suffice."""
    vocab = scaled.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k > _NUM_CANDIDATES and k != vocab:
        return None  # a large explicit top-k: its normaliser needs all k logits
    values, ids = torch.topk(scaled, min(k, _NUM_CANDIDATES))
    log_norm = torch.logsumexp(values if k <= _NUM_CANDIDATES else scaled, dim=-1)
    probs = (values - log_norm).exp()
    cum = probs.cumsum(-1)
    if k > _NUM_CANDIDATES and (top_p >= 1.0 or cum[-1] < top_p):
        return None  # the nucleus (or the whole distribution) reaches past the candidates
    keep = cum - probs < top_p
    choice = torch.multinomial(probs * keep, 1, generator=generator)
    return int(ids[choice])


def _logprobs(raw_logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top = []
    if num_top > 0:
        values, ids = torch.topk(raw_logprobs, num_top)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(raw_logprobs[token]), top)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of fp32 logits [num_seqs, vocab]; logprobs are of the model's raw distribution."""
    wants_logprobs = [seq.params.logprobs is not None for seq in seqs]
    raw = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
    logits = apply_penalties(logits, seqs)
    apply_logits_processors(logits, seqs)
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.is_greedy:
            continue
        scaled = logits[row] / params.temperature
        token = _sample_candidates(scaled, params.top_k, params.top_p, seq.generator)
        if token is None:
            probs = torch.softmax(_filter_top_k_top_p(scaled, params.top_k, params.top_p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        tokens[row] = token
    lps = [(_logprobs(raw[row], tokens[row], seq.params.logprobs) if wants_logprobs[row] else None)
           for row, seq in enumerate(seqs)]
    return tokens, lps
