"""Iteration-level scheduling: which sequences run this step, and how many of their tokens."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from server.engine.sequence import Sequence, SeqStatus


class SlotAllocator:
    """Hands out KV-cache slots (one per running sequence), lowest first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed position."""

    seq: Sequence
    num_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed

    @property
    def completes_seq(self) -> bool:
        """True when this chunk reaches the sequence's newest token, so it yields a next token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    """Waiting queue + running batch under max_num_seqs and a per-step token budget.

    Each step: every running sequence in decode gets its one token first (so decodes never starve),
    then running prefills continue, then waiting sequences are admitted while slots and budget last.
    Long prompts are cut into chunks of whatever budget remains (chunked prefill).
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots = SlotAllocator(max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_requests(self) -> int:
        """Waiting requests (the n choices of one request count once), for admission control."""
        return len({seq.request_id for seq in self.waiting})

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        chunks = [ScheduledChunk(s, 1) for s in decodes]
        budget -= len(chunks)
        for seq in prefills:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and self.slots.num_free:
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SeqStatus.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.monotonic()
            self.running.append(seq)
            n = min(seq.num_tokens, budget)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queue or batch, free its slot, record why it ended."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.slots.free(seq.slot)
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
