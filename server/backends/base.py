"""The backend protocol the engine drives: load a model, allocate KV slots, run one batched step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions start_pos.. of its cache.

    The cache is `slot` on backends that hold one slot per sequence, or the blocks of `block_table`
    (block_size positions each, in order) on paged backends.
    """

    slot: int
    token_ids: list[int]
    start_pos: int
    needs_logits: bool = True
    block_table: list[int] | None = None
    all_logits: bool = False  # logits of every position of the chunk, in order (prompt logprobs)
    wants_hidden: bool = False  # the hidden state of its logits row too (hidden_rows; an embedding request)
    lora: str | None = None  # the LoRA adapter its tokens run through (backends with supports_lora; None: none)


class ModelRunner(Protocol):
    """What every backend (torch, neuron) provides to the scheduler."""

    vocab_size: int
    max_model_len: int

    def load(self) -> None:
        """Load weights (and compile, where the backend compiles)."""

    supports_paged_kv: bool  # True: allocate_kv_blocks + block tables (the engine can share prefix blocks)
    supports_prompt_logprobs: bool  # True: honours SeqChunk.all_logits (absent: False)
    supports_embeddings: bool  # True: hidden_rows() after a step with SeqChunk.wants_hidden (absent: False)
    supports_lora: bool  # True: SeqChunk.lora applies the adapters it was given (absent: False)

    def allocate_kv(self, num_slots: int) -> None:
        """Reserve KV storage for `num_slots` concurrent sequences of up to max_model_len tokens."""

    def allocate_kv_blocks(self, num_blocks: int, block_size: int) -> None:
        """Paged backends: reserve `num_blocks` blocks of `block_size` positions, addressed by block tables."""

    def kv_bytes_per_token(self) -> int:
        """Paged backends: KV bytes one cached token takes (sizes the pool from a memory budget)."""

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Run one forward over all chunks; fp32 logits, one row per chunk with needs_logits (its last
        position), or one per position for a chunk with all_logits (backends with supports_prompt_logprobs)."""

    def hidden_rows(self) -> torch.Tensor:
        """The last execute's final hidden states (after the model's last norm), one per logits row."""

    def release_slot(self, slot: int) -> None:
        """Forget a finished sequence's cache slot (may be a no-op)."""
