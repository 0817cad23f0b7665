"""Per-sequence sampling settings: the one place request fields become engine behaviour.

Everything here is plain, picklable data (the engine may run in another process): a structured-output
constraint travels as a `StructuredOutput` spec and becomes a grammar matcher only inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class StructuredOutput:
    """A decoding constraint: `kind` says how to read `value`.

    json_schema: output matches the schema (JSON text); json_object: any JSON object (value unused);
    regex: output matches the regular expression (Rust regex syntax); choice: output is one of the strings
    of a JSON list; grammar: a GBNF (llama.cpp's) or Lark grammar from a client;
    lark: a Lark grammar in llguidance's dialect (may embed `%json {schema}`), used for tool calls.
    structural_tag: vLLM's {structures, triggers} as JSON: free text, each structure held to its schema from its
    trigger on (compiled to lark by structured.structural_tag_grammar, which needs the tokenizer's special tokens).
    whitespace_pattern: for the JSON kinds, a regex for the whitespace allowed between tokens (default none).
    after: the output's tokens up to and including these (a reasoning model's `</think>`) are left free.
    """

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark", "structural_tag"]
    value: str = ""
    whitespace_pattern: str | None = None
    # the tokens the constrained part follows (a reasoning model's `</think>`): until the output holds them, the
    # reply thinks unconstrained; empty: constrained from the first token
    after: tuple[int, ...] = ()


@dataclass
class SamplingParams:
    """How to pick and when to stop; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0: off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens (1: off)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled (None: any)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never completed in the output
    logprobs: int | None = None  # number of top alternatives per token (0..MAX_LOGPROBS), None: off
    prompt_logprobs: int | None = None  # the same for every prompt token (echo + logprobs); None: off
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    structured: StructuredOutput | None = None
    prediction: list[int] | None = None  # the reply's expected tokens (OpenAI's Predicted Outputs): draft source
    embed: bool = False  # a pooling request: the prompt's last hidden state (after the final norm), no tokens
    priority: int = 0  # under engine.scheduling_policy priority: lower is admitted (and kept) first
    lora: str | None = None  # the LoRA adapter (one of engine.lora_modules) the sequence runs through; None: none
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only between requests of the same salt

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        for value in (self.logprobs, self.prompt_logprobs):
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not ids for ids in self.bad_words_ids):
            raise ValueError("a bad word must have at least one token")
        if any(abs(v) > MAX_LOGIT_BIAS for v in self.logit_bias.values()):
            raise ValueError(f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logits_processors(self) -> bool:
        """Whether apply_logits_processors has anything to do for this sequence."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0 or self.min_p > 0.0
                    or self.structured is not None or self.allowed_token_ids is not None or self.bad_words_ids)
