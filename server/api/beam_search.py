"""Beam search (vLLM's `use_beam_search`) for completions and chat, on top of the engine's one-token requests.

As vLLM's V1 server runs it: each step asks the engine for one token of every live beam (the prompt and the beam's
tokens so far, `max_tokens` 1) with the 2 x width likeliest next tokens' logprobs, so a beam's prefix comes from the
prefix cache and a step recomputes at most its last partial block. The width likeliest candidates go on; one that
ends in an end token (EOS unless ignore_eos, or a stop token id) is complete. At the end the beams are ranked by
cumulative logprob over length ** length_penalty, the length counting the prompt as vLLM counts it.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.engine.sequence import TokenLogprob

# The next-token logprobs of each of a step's prefixes (prompt + a beam's tokens), one TokenLogprob per prefix.
NextTokens = Callable[[list[list[int]], int], Awaitable[list[TokenLogprob]]]


@dataclass(frozen=True)
class Beam:
    """A candidate reply: its tokens, their summed logprob, and whether an end token closed it."""

    tokens: tuple[int, ...]
    logprob: float
    ended: bool = False

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = max(1, prompt_len + len(self.tokens) - int(self.ended))  # the end token does not count (vLLM)
        # logprob / length ** length_penalty, its exponent held where a float has room: a penalty of 1e16 would
        # overflow the power, and -1e16 turn it to 0 and the division into an error
        return self.logprob * math.exp(min(700.0, max(-700.0, -length_penalty * math.log(length))))


async def beam_search(next_tokens: NextTokens, prompt: list[int], width: int, max_tokens: int,
                      end_ids: frozenset[int], length_penalty: float = 1.0) -> list[Beam]:
    """The `width` best replies to `prompt`, best first; `next_tokens` runs one engine step over the live beams."""
    live, done = [Beam((), 0.0)], []
    for _ in range(max_tokens):
        steps = await next_tokens([prompt + list(b.tokens) for b in live], 2 * width)
        candidates = []
        for beam, step in zip(live, steps):
            for token, logprob in step.top:
                extended = Beam(beam.tokens + (token,), beam.logprob + logprob, token in end_ids)
                (done if extended.ended else candidates).append(extended)
        live = sorted(candidates, key=lambda b: -b.logprob)[:width]  # stable: ties keep the engine's order
        if not live:
            break
    ranked = sorted(done + live, key=lambda b: -b.score(len(prompt), length_penalty))
    return ranked[:width]
