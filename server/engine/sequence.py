"""A sequence's state as it moves waiting -> running -> finished, and what one step emits for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.predicted import PredictedOutput
from server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: SeqOutput crosses to the API process, which need not import torch to spawn the core
    import torch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Log-probability of a chosen token and its top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1 + how many tokens were likelier (kept for prompt tokens, as vLLM reports them)


@dataclass
class SeqOutput:
    """What one engine step produced for one sequence (deltas since the last output)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with the first token, when asked: one entry per prompt token (None for the first, which has no context)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with a predicted reply: its drafted tokens the reply kept and those the model refused, so far
    prediction_tokens: tuple[int, int] | None = None
    embedding: list[float] | None = None  # a pooling request's: the prompt's last hidden state
    stop_reason: int | str | None = None  # with a "stop" finish: the stop token id or string (None: EOS)
    error_status: int = 500  # the HTTP status an error means (400: the request asked what cannot be done)

    @classmethod
    def failed(cls, request_id: str, message: str, num_prompt_tokens: int = 0) -> SeqOutput:
        """The one output of a request the engine could not serve: an error that ends it (the API's 500)."""
        return cls(request_id, 0, "", [], None, "error", num_prompt_tokens, 0, message)

    def followed_by(self, later: SeqOutput) -> SeqOutput:
        """This output and the same sequence's next one as one delta (the API's --stream-interval sends them so)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else [*(self.logprobs or []),
                                                                                  *(later.logprobs or [])]
        return SeqOutput(request_id=later.request_id, index=later.index, text=self.text + later.text,
                         token_ids=[*self.token_ids, *later.token_ids], logprobs=logprobs,
                         finish_reason=later.finish_reason, num_prompt_tokens=later.num_prompt_tokens,
                         num_output_tokens=later.num_output_tokens, error=later.error,
                         num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
                         prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None
                         else later.prompt_logprobs, prediction_tokens=later.prediction_tokens,
                         embedding=later.embedding, stop_reason=later.stop_reason, error_status=later.error_status)


@dataclass
class Sequence:
    """One generated choice of a request; `index` is its position among the request's n choices."""

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    slot: int = -1  # slot-cache backends
    block_table: list[int] = field(default_factory=list)  # paged backends: cache blocks, in position order
    num_hashed_blocks: int = 0  # leading blocks published to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (usage reports them)
    num_computed: int = 0  # tokens whose K/V are in the cache
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it (None: EOS)
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted into the running batch
    first_token_time: float | None = None
    last_token_time: float | None = None
    last_itl: float | None = None  # seconds between the two newest tokens
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # filled chunk by chunk
    logits_state: object | None = None  # owned by engine.logits_processors (grammar matcher, caches)
    prediction: PredictedOutput | None = None  # the reply the request predicts, and where this one stands in it
    embedding: list[float] | None = None  # an embedding request's vector, once its prompt is computed
    # what its first KV block's hash chains from (None: the base model, no salt): blocks computed under another key
    # (another LoRA adapter, or one loaded again under the same name; another cache_salt) are never shared with it
    prefix_key: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt still has to be scored position by position (so no prefix-cache hit may skip any)."""
        return self.params.prompt_logprobs is not None and not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
