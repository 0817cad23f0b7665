"""Structured output through llguidance: grammars from StructuredOutput specs, per-sequence matchers.

llguidance (guidance-ai, the engine behind vLLM's `guidance` backend) compiles JSON schemas and Lark
grammars lazily and computes a token mask in about a millisecond for a 49k vocabulary; it is one
wheel with no dependencies (xgrammar pulls triton and tvm-ffi, outlines-core's JSON support needs the
outlines stack).
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.hf
import torch

from server.engine.json_grammar import JSON_OPTIONS
from server.engine.sampling_params import StructuredOutput

_ANY_OBJECT = '{"type": "object"}'


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (about 0.3 s to build, so cached)."""
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The exact bytes a token stands for (a byte-fallback token is part of a UTF-8 character)."""
    return ll_tokenizer(tokenizer).decode_bytes([token_id])


def structural_tag_grammar(value: str, special_tokens: frozenset[str]) -> str:
    """The Lark grammar of a structural_tag spec (its JSON {structures, triggers}): free text, in which text reaching
    a trigger continues as one structure's begin, JSON for its schema (under the json_schema specs' options) and its
    end. A trigger written as a special token (`<|python_tag|>`) is matched as that token where the tokenizer has it
    (ValueError where triggers of that form are special in part only: llguidance takes one reading for all)."""
    tags = json.loads(value)
    triggers = tags["triggers"]
    bracketed = [t for t in triggers if t.startswith("<") and t.endswith(">")]
    special = [t in special_tokens for t in bracketed]
    if any(special) and not all(special):
        raise ValueError("structural_tag: triggers of the form <...> must all be special tokens or none")
    structs = []
    for s in tags["structures"]:
        trigger = max((t for t in triggers if s["begin"].startswith(t)), key=len)
        schema = {**s.get("schema", {"type": "object"}), "x-guidance": JSON_OPTIONS}
        structs.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s.get("end", "")))
    return llguidance.StructTag.to_grammar(structs, assume_special=any(special))


def grammar_for(spec: StructuredOutput) -> str:
    """The llguidance grammar (serialised) for a spec (ValueError for a GBNF grammar it cannot read)."""
    if spec.kind in ("json_object", "json_schema"):
        options = JSON_OPTIONS
        if spec.whitespace_pattern is not None:
            options = {**JSON_OPTIONS, "whitespace_pattern": spec.whitespace_pattern}
        schema = _ANY_OBJECT if spec.kind == "json_object" else spec.value
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    return llguidance.grammar_from(spec.kind, spec.value)  # regex, choice (a JSON list), grammar (GBNF or Lark)


def grammar_error(spec: StructuredOutput) -> str | None:
    """Why a spec cannot be compiled (e.g. an invalid JSON schema), or None if it can."""
    if spec.kind == "json_schema":
        try:
            json.loads(spec.value)
        except ValueError as exc:
            return f"not JSON: {exc}"
    try:
        return llguidance.LLMatcher.validate_grammar(grammar_for(spec)) or None
    except ValueError as exc:
        return str(exc)


class GrammarMatcher:
    """Tracks one sequence's output against its grammar and masks the logits of its next token."""

    def __init__(self, spec: StructuredOutput, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar_for(spec), log_level=0)
        self.after = list(spec.after)
        self.start: int | None = None if self.after else 0  # where the constrained output begins, once known
        self.num_consumed = 0
        self._bitmask = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)

    @property
    def active(self) -> bool:
        """Whether the output is in its constrained part (past `after`, where the spec has one)."""
        return self.start is not None

    def advance(self, output_ids: list[int]) -> None:
        """Feed the constrained output's tokens not yet consumed (rewinding if the output got shorter)."""
        if self.after and (self.start is None or len(output_ids) < self.start):
            self.start = _end_of(self.after, output_ids)
        if self.start is None:
            return
        constrained = output_ids[self.start:]
        if len(constrained) < self.num_consumed:
            self.matcher.reset()
            self.num_consumed = 0
        new = constrained[self.num_consumed:]
        if new:
            self.matcher.consume_tokens(new)
            self.num_consumed = len(constrained)

    @property
    def is_done(self) -> bool:
        """The grammar is complete (or the output left it): only EOS may follow."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())

    def mask(self, logits: torch.Tensor) -> None:
        """Set logits [vocab] of tokens the grammar forbids to -inf (everything but EOS once done; nothing before
        the constrained part)."""
        if not self.active:
            return
        if self.is_done:
            logits.fill_(float("-inf"))
            logits[self.eos] = 0.0
            return
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        allowed = ((self._bitmask.unsqueeze(-1) >> self._bits) & 1).flatten()[:logits.shape[-1]].bool()
        if self.matcher.is_accepting():
            allowed[self.eos] = True
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def _end_of(marker: list[int], ids: list[int]) -> int | None:
    """The index just past the first occurrence of `marker` in `ids`, None if it does not occur."""
    for i in range(len(ids) - len(marker) + 1):
        if ids[i:i + len(marker)] == marker:
            return i + len(marker)
    return None
