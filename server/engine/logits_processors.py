"""Per-sequence logits edits beyond temperature/top-k/top-p: logit_bias, allowed_token_ids, bad_words,
min_tokens, repetition_penalty, min_p and the structured-output grammar mask.

`apply_logits_processors` is the one entry the sampler calls (after the presence/frequency penalties).
What a sequence needs between steps (its grammar matcher, its prompt's token set) lives lazily in
`seq.logits_state`, built inside the engine from plain data, so nothing here needs an engine hook.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from server.engine.sequence import Sequence
from server.engine.structured import GrammarMatcher

log = logging.getLogger(__name__)


@dataclass
class LogitsState:
    """What a sequence's processors keep between steps."""

    prompt_ids: torch.Tensor | None = None  # unique prompt token ids (repetition penalty)
    banned_outside: torch.Tensor | None = None  # bool [vocab]: True for tokens allowed_token_ids leaves out
    grammar: GrammarMatcher | None = None
    grammar_error: str | None = None  # why the matcher gave up on the grammar (the engine then fails the sequence)


def _state(seq: Sequence, vocab_size: int) -> LogitsState:
    if seq.logits_state is None:
        state = LogitsState()
        if seq.params.repetition_penalty != 1.0:
            state.prompt_ids = torch.tensor(sorted(set(seq.prompt_ids)), dtype=torch.long)
        if seq.params.allowed_token_ids is not None:
            state.banned_outside = torch.ones(vocab_size, dtype=torch.bool)
            state.banned_outside[[t for t in seq.params.allowed_token_ids if 0 <= t < vocab_size]] = False
        if seq.params.structured is not None:
            state.grammar = GrammarMatcher(seq.params.structured, seq.detok.tokenizer, vocab_size,
                                           seq.eos_token_ids)
        seq.logits_state = state
    return seq.logits_state


def _logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor([t for t in bias if 0 <= t < row.shape[-1]], dtype=torch.long, device=row.device)
    values = torch.tensor([bias[t] for t in ids.tolist()], dtype=row.dtype, device=row.device)
    row.index_add_(0, ids, values)


def _bad_words(row: torch.Tensor, seq: Sequence) -> None:
    """Ban the token that would complete a bad word: its last token, where the output ends with the rest."""
    out = seq.output_ids
    for ids in seq.params.bad_words_ids:
        prefix = ids[:-1]
        if len(out) >= len(prefix) and (not prefix or out[-len(prefix):] == prefix) and 0 <= ids[-1] < row.shape[-1]:
            row[ids[-1]] = float("-inf")


def _min_tokens(row: torch.Tensor, seq: Sequence) -> None:
    """Mask EOS and stop_token_ids while fewer than min_tokens tokens are out."""
    banned = [t for t in (*seq.eos_token_ids, *seq.params.stop_token_ids) if 0 <= t < row.shape[-1]]
    if banned:
        row[banned] = float("-inf")


def _repetition_penalty(row: torch.Tensor, seq: Sequence, state: LogitsState) -> None:
    """Divide positive logits (multiply negative ones) of every prompt or output token by the penalty."""
    ids = state.prompt_ids
    if seq.output_ids:
        ids = torch.cat([ids, torch.tensor(seq.output_ids, dtype=torch.long)])
    ids = ids.to(row.device).unique()
    seen = row[ids]
    penalty = seq.params.repetition_penalty
    row[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _min_p(row: torch.Tensor, seq: Sequence) -> None:
    """Drop tokens whose probability at the sequence's temperature is under min_p x the top one's."""
    params = seq.params
    if params.is_greedy:
        return  # greedy picks the top token, which min_p always keeps
    threshold = row.max() + params.temperature * math.log(params.min_p)
    row.masked_fill_(row < threshold, float("-inf"))


def _grammar(row: torch.Tensor, seq: Sequence, state: LogitsState) -> None:
    grammar = state.grammar
    grammar.advance(seq.output_ids)
    if grammar.matcher.is_error() and state.grammar_error is None:
        state.grammar_error = grammar.matcher.get_error() or "the grammar engine stopped"
        log.warning("request %s left its grammar (%s); ending it", seq.request_id, state.grammar_error)
    grammar.mask(row)
    if torch.isneginf(row).all():  # min_tokens banned the only token the grammar allows: end anyway
        row[grammar.eos] = 0.0


def grammar_error(seq: Sequence) -> str | None:
    """Why the sequence's grammar matcher gave up (a parser limit it reached, a token it could not take), if it did:
    its forced EOS is then no answer to give as a normal stop."""
    state = seq.logits_state
    return state.grammar_error if isinstance(state, LogitsState) else None


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Edit fp32 logits [num_seqs, vocab] in place, row i for seqs[i]."""
    for row, seq in enumerate(seqs):
        params = seq.params
        if not params.has_logits_processors:
            continue
        state = _state(seq, logits.shape[-1])
        r = logits[row]
        if params.logit_bias:
            _logit_bias(r, params.logit_bias)
        if state.banned_outside is not None:
            r.masked_fill_(state.banned_outside.to(r.device), float("-inf"))
        if params.bad_words_ids:
            _bad_words(r, seq)
        if len(seq.output_ids) < params.min_tokens:
            _min_tokens(r, seq)
        if params.repetition_penalty != 1.0:
            _repetition_penalty(r, seq, state)
        if state.grammar is not None:
            _grammar(r, seq, state)
        if params.min_p > 0.0:  # after the grammar, so the threshold is relative to an allowed token
            _min_p(r, seq)
