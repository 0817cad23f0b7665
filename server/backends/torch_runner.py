"""PyTorch backend (CPU, or CUDA when present): the compact Llama over a slot KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from server.backends.base import SeqChunk
from server.models.cpu_features import resolve_dtype
from server.models.fused_ops import kernels_for
from server.models.llama import Attention, FlatBatch, KVCache, LlamaModel, PrefillChunk
from server.models.loader import load_llama
from server.models.packed_linear import pack_linears, packing_available

log = logging.getLogger(__name__)


class TorchRunner:
    """Runs flat mixed prefill/decode batches through `LlamaModel` on one device.

    The cache holds one block of max_model_len positions per slot (block_size = max_model_len), so a
    sequence's block table is its slot.
    """

    def __init__(self, model_dir: Path, max_model_len: int, dtype: str = "auto", device: str = "cpu",
                 compressed: Path | None = None, num_threads: int | None = None, pack_weights: bool = True,
                 fused_kernels: bool = True):
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.compressed = compressed
        self.num_threads = num_threads
        self.pack_weights = pack_weights
        self.fused_kernels = fused_kernels
        self.model: LlamaModel | None = None
        self.cache: KVCache | None = None
        self.vocab_size = 0

    def load(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.model = load_llama(self.model_dir, self.max_model_len, self.dtype, self.compressed).to(self.device)
        self.vocab_size = self.model.config.vocab_size
        if self.pack_weights and packing_available(self.device, self.dtype):
            pack_linears(self.model)
        if self.fused_kernels:
            self.model.use_kernels(kernels_for(self.device))

    def allocate_kv(self, num_slots: int) -> None:
        cfg = self.model.config
        self.cache = KVCache(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, self.max_model_len,
                             cfg.head_dim, self.dtype, self.device)
        log.info("KV cache: %d slots x %d tokens, %.0f MiB reserved (committed as used)",
                 num_slots, self.max_model_len, self.cache.nbytes() / 2**20)

    def build_batch(self, chunks: list[SeqChunk]) -> FlatBatch:
        """Flatten chunks into the model's FlatBatch (one host->device copy per field)."""
        ids, positions, slot_mapping, seq_index, context_lens, logits_index = [], [], [], [], [], []
        sdpa_chunks = []
        for row, chunk in enumerate(chunks):
            n, start = len(chunk.token_ids), chunk.start_pos
            if start + n > self.max_model_len:
                raise ValueError(f"sequence in slot {chunk.slot} exceeds max_model_len {self.max_model_len}")
            fused = n < Attention.SDPA_MIN_CHUNK
            if not fused:
                sdpa_chunks.append(PrefillChunk(len(ids), n, row, start))
            ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slot_mapping.extend(range(chunk.slot * self.max_model_len + start, chunk.slot * self.max_model_len + start + n))
            seq_index.extend([row] * n)
            context_lens.extend(range(start + 1, start + n + 1) if fused else [0] * n)
            if chunk.needs_logits:
                logits_index.append(len(ids) - 1)
        as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=self.device)  # noqa: E731
        return FlatBatch(
            input_ids=as_tensor(ids), positions=as_tensor(positions), slot_mapping=as_tensor(slot_mapping),
            seq_index=as_tensor(seq_index, torch.int32), context_lens=as_tensor(context_lens, torch.int32),
            block_tables=as_tensor([[c.slot] for c in chunks], torch.int32),
            logits_index=as_tensor(logits_index), sdpa_chunks=sdpa_chunks)

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        return self.model(self.build_batch(chunks), self.cache)

    def release_slot(self, slot: int) -> None:
        """Slots are overwritten position by position; nothing to clear."""
