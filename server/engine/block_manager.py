"""KV-cache memory for the engine: fixed-size blocks per sequence, or one slot per sequence.

`PagedKV` hands out blocks of `block_size` token positions and keeps a block table per sequence. With
prefix caching on, every full block is known by a hash chained from its parent's hash and its token
ids (as nano-vllm and vLLM do): a new sequence whose prompt starts with the same tokens shares those
blocks (reference-counted) and skips their prefill. Blocks no sequence holds stay reusable, by hash,
until the least recently freed is taken for new tokens.

`SlotKV` is the same interface for backends that manage their own cache (one slot per sequence, no
sharing): the engine then schedules exactly as before paging.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from server.engine.sequence import Sequence


@dataclass
class KVStats:
    """Counters since start, for /metrics (the engine ships them in each step's stats)."""

    num_blocks: int
    num_used_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0


class PagedKV:
    """Block allocator with hash-chained prefix caching and LRU reuse of freed blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block holding those tokens
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first
        self.stats = KVStats(num_blocks)

    # ---- capacity ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    num_free = num_free_blocks  # the name SlotKV shares

    @property
    def capacity(self) -> int:
        return self.stats.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, seq: Sequence) -> bool:
        """Whether the whole prompt (and what it has generated, after a preemption) fits now."""
        needed = self.blocks_for(seq.num_tokens) - len(self._cached_prefix(seq))
        return needed <= self.num_free_blocks

    # ---- sequence lifecycle -------------------------------------------------------------------
    def admit(self, seq: Sequence) -> None:
        """Give a waiting sequence its blocks; cached prefix blocks are shared and marked computed."""
        assert not seq.block_table, "a sequence is admitted holding no blocks"
        hits = self._cached_prefix(seq)
        for block in hits:
            self._take(block)
        seq.block_table = hits + [self._take(self._evict_one()) for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.num_computed = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = seq.num_cached_tokens or seq.num_computed
        if self.enable_prefix_caching:
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += seq.num_computed

    def ensure_next_slot(self, seq: Sequence) -> bool:
        """Make room for the sequence's newest token; False when no block is free (the caller preempts)."""
        if len(seq.block_table) * self.block_size >= seq.num_tokens:
            return True
        if not self.free:
            return False
        seq.block_table.append(self._take(self._evict_one()))
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks the sequence has completely computed, for later prompts to share."""
        if not self.enable_prefix_caching:
            return
        tokens = None
        for index in range(seq.num_hashed_blocks, seq.num_computed // self.block_size):
            tokens = tokens or seq.prompt_ids + seq.output_ids
            parent = self.block_hash[seq.block_table[index - 1]] if index else None
            block = seq.block_table[index]
            h = hash((parent, tuple(tokens[index * self.block_size:(index + 1) * self.block_size])))
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
            elif self.block_hash[block] is None:  # another block already holds these tokens: chain through it
                self.block_hash[block] = h
            seq.num_hashed_blocks = index + 1

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's blocks; unshared ones become free (still findable by hash until reused)."""
        for block in reversed(seq.block_table):  # tail blocks first: they are the least likely to be shared
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:  # nothing cached in it: reuse it first, so the memory
                    self.free.move_to_end(block, last=False)  # touched stays as small as the work needs
                self.stats.num_used_blocks -= 1
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence to recompute it later (its prompt and output so far)."""
        self.release(seq)
        seq.num_computed = 0
        self.stats.preemptions += 1

    # ---- internals ----------------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding the sequence's leading full blocks; never all of it (the newest
        token must run through the model to give logits)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logits:  # cached positions give no logits
            return []
        tokens = seq.prompt_ids + seq.output_ids
        hits, parent = [], None
        for index in range((len(tokens) - 1) // self.block_size):
            h = hash((parent, tuple(tokens[index * self.block_size:(index + 1) * self.block_size])))
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def _evict_one(self) -> int:
        """The least recently freed block, forgetting the tokens it cached."""
        block = next(iter(self.free))
        if self.block_hash[block] is not None:
            if self.cached.get(self.block_hash[block]) == block:
                del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        return block

    def _take(self, block: int) -> int:
        if self.ref_counts[block] == 0:
            del self.free[block]
            self.stats.num_used_blocks += 1
        self.ref_counts[block] += 1
        return block


class SlotKV:
    """One cache slot per sequence, lowest first (for backends that keep their own cache)."""

    block_size = None
    enable_prefix_caching = False

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = KVStats(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.stats.num_blocks

    def can_admit(self, seq: Sequence) -> bool:
        return bool(self._free)

    def admit(self, seq: Sequence) -> None:
        seq.slot = self._free.pop()
        seq.num_computed = 0
        self.stats.num_used_blocks += 1

    def ensure_next_slot(self, seq: Sequence) -> bool:
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Nothing to share."""

    def release(self, seq: Sequence) -> None:
        self._free.append(seq.slot)
        self._free.sort(reverse=True)
        self.stats.num_used_blocks -= 1

    def preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.num_computed = 0
        self.stats.preemptions += 1
