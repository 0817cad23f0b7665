"""Incremental detokenisation with stop strings that are never emitted, not even in part."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; holds back a possible stop-string prefix."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special = skip_special_tokens
        self.include_stop = include_stop  # keep the matched stop string (vLLM's include_stop_str_in_output)
        self.text = ""
        self.matched: str | None = None  # the stop string that ended the text
        self.emitted = 0  # chars of self.text already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def append(self, ids: list[int]) -> bool:
        """Add the newest token (ids is the whole output so far); True if a stop string ended the text."""
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        # A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [(at, len(stop)) for stop in self.stop if (at := self.text.find(stop, search_from)) != -1]
        if hits:
            at, length = min(hits)
            self.matched = self.text[at:at + length]
            self.text = self.text[:at + length if self.include_stop else at]
            return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, keep back what could still become a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self._holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
