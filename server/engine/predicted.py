"""Drafts from a request's predicted reply (OpenAI's Predicted Outputs): the tokens the client expects next.

An edit of a document or of code mostly repeats the text the client already has. Given that text as the
prediction, each decoding step drafts the prediction's next tokens from where the reply stands in it, and the model
checks them in the same forward (speculative decoding, as with prompt-lookup drafts): the reply is the model's own,
token for token, and every agreed token costs a fraction of a step. Where the reply leaves the prediction (the
edit itself), the draft resumes once the reply's newest tokens are found in the prediction again.
"""

from __future__ import annotations

from array import array

from server.engine.ngram import ID_WIDTH, find_whole

# Tokens a step drafts from a prediction (unless engine.speculative sets num_speculative_tokens): a batch-1 step
# streams the weights whatever its rows, so a long draft of a mostly right prediction is nearly free.
PREDICTION_DRAFT_TOKENS = 8
_REALIGN_MAX = 3  # the longest tail of the reply looked up in the prediction to find where it resumes
_REALIGN_NEAR = 16  # a single token places the reply only this close after where it left the prediction
_MAX_MISSES = 3  # drafts shrink to an eighth at most: a reply may come back to its prediction


class PredictedOutput:
    """A prediction's tokens, where the reply stands in them, and how many of them the reply kept or refused."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = list(token_ids)
        self._data = array("i", self.token_ids).tobytes()
        self.next: int | None = 0  # the position the reply's next token should match (None: it left the prediction)
        self.followed = 0  # the reply matched the prediction up to here: where to look for it first when it left
        self.accepted = 0  # drafted prediction tokens the reply kept
        self.rejected = 0  # drafted prediction tokens the model refused
        self.misses = 0  # drafts in a row the model refused whole: each halves the next (a reply that went elsewhere)

    def draft(self, output_ids: list[int], num: int) -> list[int]:
        """The prediction's next tokens after the reply so far, up to `num` (≥ 1; fewer after drafts refused whole;
        [] where the reply cannot be placed in it)."""
        if self.next is None:
            self.next = self._resume_point(output_ids)
        return [] if self.next is None else self.token_ids[self.next:self.next + max(num >> self.misses, 1)]

    def follow(self, new_tokens: list[int], draft: list[int]) -> None:
        """Follow the reply's new tokens: a step's checked draft lead and the model's own token after it, or one
        token; count the draft's tokens as kept or refused when it was this prediction's."""
        if draft and self.next is not None and draft == self.token_ids[self.next:self.next + len(draft)]:
            kept = 0
            while kept < min(len(draft), len(new_tokens)) and new_tokens[kept] == draft[kept]:
                kept += 1
            self.accepted += kept
            self.rejected += len(draft) - kept
            self.misses = 0 if kept else min(self.misses + 1, _MAX_MISSES)
        for token in new_tokens:
            if self.next is not None and self.next < len(self.token_ids) and self.token_ids[self.next] == token:
                self.next += 1
                self.followed = self.next
            else:
                self.next = None

    def _resume_point(self, output_ids: list[int]) -> int | None:
        """Where the prediction goes on after the reply's newest tokens: the first occurrence of the reply's longest
        tail (3 tokens down to 2) at or after the point the reply left the prediction, else anywhere, else of its
        newest token within a few tokens of that point (a word replaced, or a few inserted); None if none. After
        _MAX_MISSES drafts refused whole in a row, only a 3-token tail places it (the reply went elsewhere)."""
        shortest = _REALIGN_MAX if self.misses >= _MAX_MISSES else 2
        for n in range(min(_REALIGN_MAX, len(output_ids)), shortest - 1, -1):
            tail = array("i", output_ids[-n:]).tobytes()
            at = find_whole(self._data, tail, self.followed * ID_WIDTH)
            if at == -1:
                at = find_whole(self._data, tail, 0)
            if at != -1:
                return at // ID_WIDTH + n
        if output_ids and self.misses < _MAX_MISSES:
            window = self.token_ids[self.followed:self.followed + _REALIGN_NEAR]
            if output_ids[-1] in window:
                return self.followed + window.index(output_ids[-1]) + 1
        return None
