"""Iteration-level scheduling: which sequences run this step, and how many of their tokens."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from server.engine.block_manager import PagedKV, SlotKV
from server.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledTokens:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed position; a decode with a speculative
    `draft` runs its newest token and then the draft's, whose positions the model checks in the same forward."""

    seq: Sequence
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.seq.num_computed

    @property
    def completes_seq(self) -> bool:
        """True when this chunk reaches the sequence's newest token, so it yields a next token."""
        return self.seq.num_computed + self.num_tokens - len(self.draft) == self.seq.num_tokens

    def token_ids(self) -> list[int]:
        """The tokens the forward runs: the sequence's, then the draft's."""
        end = self.start + self.num_tokens - len(self.draft)
        return self.seq.token_slice(self.start, end) + self.draft


class Scheduler:
    """Waiting queue + running batch under max_num_seqs, a per-step token budget and the KV memory.

    Each step: every running sequence in decode gets its one token first (so decodes never starve),
    making room in the KV cache for it, and preempting the newest sequence (freed, requeued at the
    front, recomputed later) when none is left; then running prefills continue; then waiting sequences
    are admitted while slots, budget and KV blocks last. With speculation on, a decode may also take a
    draft's tokens from the budget (and the KV room for them) before any prompt does. Long prompts are cut into
    chunks of whatever budget remains (chunked prefill), at most `max_prefill_tokens_while_decoding` of them in a
    step that also decodes; a prompt prefix found in the prefix cache is not computed again. The other choices of
    an n > 1 request wait until its first has computed its prompt, whose blocks they then share: the prompt is
    computed once, not n times.

    Under the `priority` policy (vLLM's) the queue is ordered by each request's priority (lower first), then
    arrival; a preemption takes the running sequence of the latest priority (the newest among those), and a waiting
    sequence of an earlier priority than a running one preempts it when there is no room to admit it.

    With LoRA adapters, at most `max_loras` distinct adapters run at once (vLLM's --max-loras: each costs its own
    small GEMMs a projection): a waiting sequence of another adapter stays queued, and those behind it go ahead.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, kv: PagedKV | SlotKV,
                 max_prefill_tokens_while_decoding: int | None = None,
                 propose: Callable[[Sequence], list[int]] | None = None, policy: str = "fcfs",
                 max_loras: int | None = None):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.kv = kv
        self.propose = propose  # a decoding sequence's speculative draft ([] for none); None: no speculation
        self.by_priority = policy == "priority"
        self.max_loras = max_loras  # distinct LoRA adapters in the running batch (None: no limit)
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
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float, int]:
        """A sequence's place under the priority policy: its priority, then its request's arrival, then its choice."""
        return seq.params.priority, seq.arrival_time, seq.index

    def _queue(self, seq: Sequence) -> None:
        """Into the waiting queue at its rank (behind those of the same rank)."""
        at = len(self.waiting)
        while at > 0 and self._rank(self.waiting[at - 1]) > self._rank(seq):
            at -= 1
        self.waiting.insert(at, seq)

    def schedule(self) -> list[ScheduledTokens]:
        budget = self.max_num_batched_tokens
        chunks = [ScheduledTokens(s, 1) for s in self._decodes_with_room()]
        budget -= len(chunks)
        if self.propose is not None:
            for chunk in chunks:
                budget -= self._add_draft(chunk, budget)
        if chunks and self.max_prefill_tokens_while_decoding is not None:
            # a step beside running streams holds every one of them: keep its prompt tokens few (Sarathi-Serve's
            # stall-free batching); with nothing decoding, a prompt gets the whole budget
            budget = min(budget, self.max_prefill_tokens_while_decoding)
        for seq in [s for s in self.running if s.num_tokens - s.num_computed > 1]:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append(ScheduledTokens(seq, n))
            budget -= n
        held_back = []  # waiting sequences of an adapter there is no room for this step, in queue order
        while self.waiting and budget > 0 and not self._shares_a_prompt_in_prefill(self.waiting[0]):
            if not self._adapter_fits(self.waiting[0]):
                held_back.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.max_num_seqs or not self.kv.can_admit(self.waiting[0]):
                if not self._preempt_for(self.waiting[0], chunks):
                    break
                continue
            seq = self.waiting.popleft()
            self.kv.admit(seq)
            seq.status = SeqStatus.RUNNING
            seq.scheduled_time = seq.scheduled_time or time.monotonic()
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append(ScheduledTokens(seq, n))
            budget -= n
        for seq in reversed(held_back):  # back to their places
            self._queue(seq) if self.by_priority else self.waiting.appendleft(seq)
        return chunks

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether admitting `seq` keeps the running batch within max_loras distinct adapters."""
        if self.max_loras is None or seq.params.lora is None:
            return True
        running = {s.params.lora for s in self.running} - {None}
        return seq.params.lora in running or len(running) < self.max_loras

    def _shares_a_prompt_in_prefill(self, seq: Sequence) -> bool:
        """Whether `seq` is a later choice of a request whose first choice is still computing the prompt they share
        (with prefix caching, it finds that prompt's full blocks cached once the first has computed them)."""
        if seq.index == 0 or not getattr(self.kv, "enable_prefix_caching", False) or seq.wants_prompt_logits:
            return False
        if len(seq.prompt_ids) <= self.kv.block_size:  # no full block to share
            return False
        return any(s.request_id == seq.request_id and s.index == 0 and s.num_computed < len(s.prompt_ids)
                   for s in self.running)

    def _decodes_with_room(self) -> list[Sequence]:
        """Running sequences in decode, each with a cache position for its next token (preempting if needed)."""
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        ready = []
        for seq in decodes:
            if seq.status is not SeqStatus.RUNNING:  # preempted to make room for an earlier one
                continue
            while not self.kv.ensure_next_slot(seq):
                victim = self._victim()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        return [s for s in ready if s.status is SeqStatus.RUNNING]

    def _add_draft(self, chunk: ScheduledTokens, budget: int) -> int:
        """Give a decode its draft where the budget and the KV cache have room for it; the draft tokens taken."""
        draft = self.propose(chunk.seq)[:budget] if budget > 0 else []
        if not draft or not self.kv.ensure_next_slot(chunk.seq, len(draft)):
            return 0  # no draft, or no free block for one: decode one token
        chunk.draft = draft
        chunk.num_tokens += len(draft)
        return len(draft)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest (it has the least work to redo), of the latest priority under
        the priority policy."""
        return max(self.running, key=self._rank) if self.by_priority else self.running[-1]

    def _preempt_for(self, seq: Sequence, chunks: list[ScheduledTokens]) -> bool:
        """Under the priority policy, make room for `seq` by preempting a running sequence of a later priority that
        this step has not scheduled; whether one was."""
        if not self.by_priority:
            return False
        scheduled = {id(c.seq) for c in chunks}
        later = [s for s in self.running if s.params.priority > seq.params.priority and id(s) not in scheduled]
        if not later:
            return False
        self._preempt(max(later, key=self._rank))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.preempt(seq)
        seq.status = SeqStatus.WAITING
        if self.by_priority:
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)

    def mark_computed(self, chunks: list[ScheduledTokens]) -> None:
        """After the forward: the chunks' tokens are in the cache; publish full blocks for prefix reuse."""
        for c in chunks:
            c.seq.num_computed += c.num_tokens
            self.kv.register_full_blocks(c.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queue or batch, free its KV memory, record why it ended."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
