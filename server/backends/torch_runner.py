"""PyTorch backend (CPU, or CUDA when present): the compact Llama over a slot KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from server.backends.base import SeqChunk
from server.models.llama import FlatBatch, KVCache, LlamaModel, make_decode_group
from server.models.packed_linear import pack_linears, packing_available

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchRunner:
    """Runs flat mixed prefill/decode batches through `LlamaModel` on one device."""

    def __init__(self, model_dir: Path, max_model_len: int, dtype: str = "float32", device: str = "cpu",
                 compressed: Path | None = None, num_threads: int | None = None, pack_weights: bool = True):
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        self.compressed = compressed
        self.num_threads = num_threads
        self.pack_weights = pack_weights
        self.model: LlamaModel | None = None
        self.cache: KVCache | None = None
        self.vocab_size = 0

    def load(self) -> None:
        from server.models.loader import load_llama

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.model = load_llama(self.model_dir, self.max_model_len, self.dtype, self.compressed).to(self.device)
        self.vocab_size = self.model.config.vocab_size
        if self.pack_weights and packing_available(self.device, self.dtype):
            pack_linears(self.model)

    def allocate_kv(self, num_slots: int) -> None:
        cfg = self.model.config
        self.cache = KVCache(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, self.max_model_len,
                             cfg.head_dim, self.dtype, self.device)
        log.info("KV cache: %d slots x %d tokens, %.0f MiB reserved (committed as used)",
                 num_slots, self.max_model_len, self.cache.nbytes() / 2**20)

    def build_batch(self, chunks: list[SeqChunk]) -> FlatBatch:
        """Flatten chunks into the model's FlatBatch (one host->device copy per field)."""
        ids, positions, token_slots, logits_index = [], [], [], []
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.start_pos + n > self.max_model_len:
                raise ValueError(f"sequence in slot {chunk.slot} exceeds max_model_len {self.max_model_len}")
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + n))
            token_slots.extend([chunk.slot] * n)
            if chunk.needs_logits:
                logits_index.append(len(ids) - 1)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        slots, starts = [c.slot for c in chunks], [c.start_pos for c in chunks]
        lengths = [len(c.token_ids) for c in chunks]
        return FlatBatch(
            input_ids=as_long(ids), positions=as_long(positions), token_slots=as_long(token_slots),
            slots=slots, starts=starts, lengths=lengths, logits_index=as_long(logits_index),
            decode=make_decode_group(slots, starts, lengths, self.device))

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        batch = self.build_batch(chunks)
        # Zero-fill ahead of every write (never behind it), then cover the decode group's padding rows.
        for chunk in chunks:
            self.cache.ensure_finite(chunk.slot, 1, chunk.start_pos + len(chunk.token_ids))
        if batch.decode is not None:
            self.cache.ensure_finite(batch.decode.slot_lo, batch.decode.num_rows, batch.decode.max_len)
        return self.model(batch, self.cache)

    def release_slot(self, slot: int) -> None:
        """Slots are overwritten position by position; nothing to clear."""
