"""Decode steps replayed from captured CUDA graphs: one launch a step instead of one per op.

Why: a decode step of the compact Llama through the torch reference ops is ~1,500 small kernels. Launched one by one
from Python, each costs more host time than GPU time: on a lent H200 the default model's batch-1 step took 36 ms
(fp32) to 108 ms (bf16) for ~3 ms of kernels (docs/BENCHMARKS.md). As vLLM does, each padded batch size is captured
once over static input buffers (at start-up for the engine's batch sizes, else at a size's first step); a step
copies its inputs in and replays.

Padding rows (a batch of n runs as the next captured size) have no context: attention gives them zeros, and their
cache writes land in a scratch block the runner keeps out of the engine's pool.
"""

from __future__ import annotations

import logging
import time

import torch

from server.models.llama import FlatBatch, KVCache, LlamaModel

log = logging.getLogger(__name__)

# Batch sizes captured (vLLM's list starts the same way); larger batches run eagerly.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def padded_size(rows: int, max_batch: int) -> int | None:
    """The captured batch size a step of `rows` decodes runs as; None above the largest (up to max_batch)."""
    for size in BATCH_SIZES:
        if size >= rows:
            return size if size <= max_batch else None
    return None


class DecodeGraphs:
    """The model's decode step over static inputs, one captured graph per padded batch size.

    capture=False runs the same padded step eagerly (CPU tests of the padding; on CUDA, an A/B against replay).
    """

    def __init__(self, model: LlamaModel, cache: KVCache, scratch_block: int, max_batch: int, max_blocks: int,
                 capture: bool = True):
        self.model, self.cache = model, cache
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.capture = capture
        device = cache.k[0].device
        self.scratch_slot = scratch_block * cache.block_size
        long = dict(dtype=torch.long, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        self._inputs = FlatBatch(
            input_ids=torch.zeros(max_batch, **long), positions=torch.zeros(max_batch, **long),
            slot_mapping=torch.full((max_batch,), self.scratch_slot, **long),
            seq_index=torch.arange(max_batch, **int32), context_lens=torch.zeros(max_batch, **int32),
            block_tables=torch.full((max_batch, max_blocks), scratch_block, **int32), logits_index=None)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def captured_sizes(self) -> list[int]:
        """The padded batch sizes captured so far."""
        return sorted(self._graphs)

    def applies(self, batch: FlatBatch) -> bool:
        """Whether `batch` is a decode step these graphs run: one token a sequence, every token's logits."""
        rows = batch.input_ids.shape[0]
        return (not batch.sdpa_chunks and batch.logits_index is None and batch.block_tables.shape[0] == rows
                and batch.block_tables.shape[1] <= self.max_blocks and padded_size(rows, self.max_batch) is not None)

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """fp32 logits [rows, vocab] of a batch `applies` accepted, from its padded size's graph."""
        rows = batch.input_ids.shape[0]
        size = padded_size(rows, self.max_batch)
        self._load(batch, rows, size)
        if not self.capture:
            return self._step(size)[:rows]
        entry = self._graphs.get(size)
        if entry is None:
            entry = self._graphs[size] = self._record(size)
        graph, logits = entry
        graph.replay()
        return logits[:rows].clone()  # the next replay overwrites the graph's output

    def capture_up_to(self, rows: int) -> None:
        """Capture every padded size a step of up to `rows` sequences runs as, now (start-up) rather than at each
        size's first step; a no-op when not capturing."""
        if not self.capture:
            return
        start = time.perf_counter()
        sizes = [s for s in BATCH_SIZES if s <= (padded_size(rows, self.max_batch) or self.max_batch)]
        for size in sizes:
            if size not in self._graphs:
                self._pad(0, size)  # every row a padding row: the warm-up and capture write only the scratch block
                self._graphs[size] = self._record(size)
        log.info("captured the decode step as CUDA graphs for batch sizes %s in %.2f s", sizes,
                 time.perf_counter() - start)

    def _load(self, batch: FlatBatch, rows: int, size: int) -> None:
        """The batch into the static inputs' first rows; rows up to `size` padded (no context, scratch slot)."""
        inputs, width = self._inputs, batch.block_tables.shape[1]
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            getattr(inputs, name)[:rows].copy_(getattr(batch, name), non_blocking=True)
        inputs.block_tables[:rows, :width].copy_(batch.block_tables, non_blocking=True)
        inputs.block_tables[:rows, width:].fill_(0)  # read past a table only where masked: any block will do
        self._pad(rows, size)

    def _pad(self, rows: int, size: int) -> None:
        """Rows rows..size-1 of the static inputs as padding: no context, writing the scratch slot."""
        if size > rows:
            inputs = self._inputs
            inputs.slot_mapping[rows:size].fill_(self.scratch_slot)
            inputs.context_lens[rows:size].fill_(0)
            inputs.positions[rows:size].fill_(0)

    def _step(self, size: int) -> torch.Tensor:
        inputs = self._inputs
        view = FlatBatch(input_ids=inputs.input_ids[:size], positions=inputs.positions[:size],
                         slot_mapping=inputs.slot_mapping[:size], seq_index=inputs.seq_index[:size],
                         context_lens=inputs.context_lens[:size], block_tables=inputs.block_tables[:size],
                         logits_index=None)
        return self.model(view, self.cache)

    def _record(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the padded step of `size` rows (after a warm-up on a side stream, as CUDA graphs need)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazily initialised kernels and cuBLAS workspaces, outside the capture
                self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(size)
        log.debug("captured the decode step for batch size %d as a CUDA graph", size)
        return graph, logits
