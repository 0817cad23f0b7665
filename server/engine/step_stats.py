"""What an engine step reports for metrics: plain records that cross from the engine process to the API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """Counters since start, for /metrics (the engine ships them in each step's stats)."""

    num_blocks: int
    num_used_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0


@dataclass
class LoraStats:
    """The LoRA adapters of the running batch and of the waiting queue after a step (vLLM's lora_requests_info)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int


@dataclass
class StepStats:
    """What one step did, for metrics."""

    batch_size: int  # sequences in the forward
    num_prompt_tokens: int  # prefill tokens computed
    num_generation_tokens: int
    ttfts: list[float] = field(default_factory=list)  # seconds, of sequences that got their first token
    queue_times: list[float] = field(default_factory=list)  # arrival -> admitted, of those same sequences
    itls: list[float] = field(default_factory=list)  # seconds between the two newest tokens, the others
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish reason, e2e seconds)
    num_draft_tokens: int = 0  # speculative draft tokens checked
    num_accepted_tokens: int = 0  # of those, the ones the model agreed with
    kv: KVStats | None = None  # the KV cache's totals after the step
    padding: dict | None = None  # static-shape backends: {(phase, bucket): counts} totals (runner.padding)
    lora: LoraStats | None = None  # with LoRA adapters enabled: which ones run and wait
