"""Incremental detokenisation with stop strings that are never emitted, not even in part.

A fast (Rust) tokenizer's text comes from its own incremental decoder, `tokenizers.decoders.DecodeStream` (as vLLM's
fast detokenizer does): one call per token, which holds a multi-byte character back until its last byte arrives. It
decodes exactly as `tokenizer.decode` does where transformers adds nothing to the Rust decoder's text (no
`clean_up_tokenization_spaces`). Any other tokenizer decodes the newest tokens twice per token, with and without
the newest, and takes the difference: 7-12 µs a token through transformers' wrapper against 4-6 µs for the stream
(warm; docs/BENCHMARKS.md), on the engine's serial path once per sequence of every step.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None


def stream_source(tokenizer):
    """The Rust tokenizer a DecodeStream can step through in place of `tokenizer.decode`, or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


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
        self._source = stream_source(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._source is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _new_text(self, ids: list[int]) -> str:
        """The text the tokens past those seen so far complete ("" while a character waits for its last byte)."""
        if self._stream is not None:
            chunks = [self._stream.step(self._source, token) for token in ids[self._read_offset:]]
            self._read_offset = len(ids)
            return "".join(chunk for chunk in chunks if chunk)
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        # A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives.
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix):]

    def append(self, ids: list[int]) -> bool:
        """Add the newest tokens (ids is the whole output so far); True if a stop string ended the text."""
        new = self._new_text(ids)
        if not new:
            return False
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
