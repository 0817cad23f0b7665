"""Seeded randomized differential stress of the engine: a random workload (arrivals, shared prefixes, chunked
prefill, a KV pool small enough to preempt, stops, n > 1, seeds, priorities, speculation, aborts) driven step by
step; every greedy reply, and every seeded one drawn among few tokens, must equal the same request's run alone, and
the KV bookkeeping and the step limits must hold at every step.

The model runs in fp32, where one GEMM kernel serves every row count (README, "Batched rows and greedy replies"), and
a seed replays its draws whatever else is in the batch (sampler.py).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest

from server.backends.torch_runner import TorchRunner
from server.engine.block_manager import PagedKV
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledTokens
from server.engine.sequence import Sequence, SeqStatus
from server.runtime import build_engine, eos_token_ids, load_tokenizer
from support import tiny_config

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    """The tiny model in fp32 on one thread (its engines share it; each allocates its own KV pool)."""
    runner = TorchRunner(tiny_model_dir, 256, "float32", num_threads=1)
    runner.load()
    return runner


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@dataclass
class Reply:
    """A sequence's whole reply, as its outputs add up."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] = field(default_factory=list)  # of the chosen tokens, where asked
    prompt_logprobs: list[tuple[int, float] | None] | None = None

    def add(self, out) -> None:
        """Append one step's output (the finish comes with the last)."""
        assert self.finish_reason is None, "output after the sequence finished"
        assert out.error is None, out.error
        self.tokens += out.token_ids
        self.text += out.text
        self.logprobs += [lp.logprob for lp in out.logprobs or ()]
        if out.prompt_logprobs is not None:
            assert self.prompt_logprobs is None, "prompt logprobs sent twice"
            self.prompt_logprobs = [lp and (lp.token_id, lp.logprob) for lp in out.prompt_logprobs]
        assert out.num_output_tokens == len(self.tokens)
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason

    def same_as(self, other: Reply) -> bool:
        """Equal tokens, text and finish; equal logprobs but for the last bits."""
        def split(lps):
            return [lp and lp[0] for lp in lps or ()], [lp[1] for lp in lps or () if lp]

        (ids, values), (other_ids, other_values) = split(self.prompt_logprobs), split(other.prompt_logprobs)
        return ((self.tokens, self.text, self.finish_reason, self.stop_reason, ids)
                == (other.tokens, other.text, other.finish_reason, other.stop_reason, other_ids)
                and self.logprobs == pytest.approx(other.logprobs, abs=1e-4)
                and values == pytest.approx(other_values, abs=1e-4))


@dataclass
class Req:
    """One request of the workload and what came back for it."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    n: int
    arrival: int  # the step it is added before
    replies: dict[int, Reply] = field(default_factory=dict)  # choice -> what came back
    aborted_in: str | None = None  # queued, prefill or decode


def _engine(tiny_model_dir, runner, tok, **engine):
    cfg = tiny_config(tiny_model_dir, max_model_len=MAX_MODEL_LEN, **engine)
    return build_engine(cfg, runner, tok, eos_token_ids(tiny_model_dir, tok))


def _alone(engine, prompt: list[int], params: SamplingParams) -> Reply:
    """The reply of one request run by itself (the engine holds nothing else)."""
    assert not engine.has_work()
    engine.add_request("alone", prompt, params)
    reply = Reply()
    for _ in range(MAX_MODEL_LEN):  # a step computes a token at least
        for out in engine.step():
            reply.add(out)
        if not engine.has_work():
            return reply
    raise AssertionError("a request alone did not finish")


class References:
    """Replies run alone on an engine of its own (a roomy pool, no prefix cache, another chunk size), memoised."""

    def __init__(self, engine):
        self.engine = engine
        self.memo: dict[tuple, Reply] = {}

    def __call__(self, prompt: list[int], params: SamplingParams, index: int = 0) -> Reply:
        if params.seed is not None:  # choice i of a seeded request samples as seed + i
            params = replace(params, seed=params.seed + index)
        key = (tuple(prompt), repr(params))
        if key not in self.memo:
            self.memo[key] = _alone(self.engine, prompt, params)
        return self.memo[key]


def _workload(rng: random.Random, refs: References, num_requests: int, policy: str, vocab: int) -> list[Req]:
    """Random requests: shared prefixes, identical prompts, long prompts, stops, n > 1, seeds, priorities, salts."""
    prefixes = [[rng.randrange(100, vocab) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    reqs, arrival = [], 0
    for i in range(num_requests):
        arrival += rng.choice((0, 0, 1, 1, 2, 5))
        if reqs and rng.random() < 0.15:  # the same prompt again
            prompt = list(rng.choice(reqs).prompt)
        else:
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = head + [rng.randrange(100, vocab) for _ in range(rng.randrange(1, 50))]
            if rng.random() < 0.2:  # a prompt that repeats itself: n-gram drafts find something
                prompt += prompt[-rng.randrange(2, 12):] * 2
        kind, sampling = rng.random(), {}
        if kind < 0.2:
            sampling = dict(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(1000), top_k=rng.choice((5, 20)),
                            top_p=rng.choice((1.0, 0.8)))
        elif kind < 0.3:  # the whole vocabulary: only its shape is checked (see _compared)
            sampling = dict(temperature=1.0, seed=rng.choice((None, rng.randrange(1000))))
        else:
            sampling = dict(temperature=0.0)
            if rng.random() < 0.15:
                sampling.update(logprobs=2, prompt_logprobs=rng.choice((0, 2)))
        if rng.random() < 0.1:
            sampling["frequency_penalty"] = 0.5
        # now and then a reply that runs into max_model_len
        max_tokens = MAX_MODEL_LEN if rng.random() < 0.05 else rng.randrange(1, 40)
        params = SamplingParams(max_tokens=max_tokens,
                                ignore_eos=rng.random() < 0.8, cache_salt=rng.choice((None, None, None, "t")),
                                priority=rng.randrange(3) if policy == "priority" else 0, **sampling)
        if _compared(params, speculative=False):
            params = _with_stop(rng, refs, prompt, params)
        n = rng.choice((1, 1, 1, 2, 3)) if not params.is_greedy or rng.random() < 0.3 else 1
        reqs.append(Req(f"r{i}", prompt, params, n, arrival))
    return reqs


def _compared(params: SamplingParams, speculative: bool) -> bool:
    """Whether a reply must equal the same request's alone: greedy ones, and seeded ones drawn among few tokens.

    A seed replays its draws whatever runs beside it, but not under speculation (a draft's length follows the room a
    step leaves). A draw over the whole vocabulary is left out: a random model's distribution there is nearly flat
    over 49k tokens, so last-bit differences in the logits (the fp32 attention kernel sums a prefill run of 4 or more
    positions in tiles, shorter ones token by token: preemption and prefix hits change the runs) move a draw across
    a boundary now and then.
    """
    return params.is_greedy or (params.seed is not None and 0 < params.top_k <= 20 and not speculative)


def _with_stop(rng: random.Random, refs: References, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """Sometimes a stop token id or a stop string taken from the free reply, so that it stops early."""
    roll = rng.random()
    if roll > 0.3 or params.max_tokens < 4:
        return params
    free = refs(prompt, params)
    if roll < 0.15:
        return replace(params, stop_token_ids=[rng.choice(free.tokens[len(free.tokens) // 2:])])
    cut = rng.randrange(len(free.text) // 2, len(free.text) + 1)
    stop = free.text[cut:cut + 3]
    return replace(params, stop=[stop]) if stop.strip() else params


def test_a_prefix_cached_in_free_blocks_takes_free_blocks_to_admit():
    """Regression: can_admit counted every cached prefix block as costing nothing, but one that nobody holds comes off
    the free list too; the scheduler then admitted a sequence the pool could not hold, and admit raised StopIteration
    (a step failed, and the blocks it had taken leaked)."""
    kv = PagedKV(num_blocks=4, block_size=4)
    one_token = SamplingParams(max_tokens=1)
    old = Sequence("old", 0, list(range(9)), one_token, detok=None)
    kv.admit(old)
    old.num_computed = old.num_tokens
    kv.register_full_blocks(old)
    kv.release(old)  # its two full blocks stay cached, free
    other = Sequence("other", 0, list(range(50, 58)), one_token, detok=None)
    kv.admit(other)  # the two open blocks
    again = Sequence("again", 0, list(range(9)) + [99], one_token, detok=None)  # the two cached blocks + one more
    assert kv.num_free_blocks == 2 and not kv.can_admit(again)
    kv.release(other)
    assert kv.can_admit(again)
    kv.admit(again)
    assert again.num_computed == 8  # its two blocks from the cache
    holder = Sequence("holder", 0, list(range(9)) + [98], one_token, detok=None)  # shares blocks now held
    assert kv.num_free_blocks == 1 and kv.can_admit(holder)
    kv.admit(holder)
    assert holder.block_table[:2] == again.block_table[:2] and kv.num_free_blocks == 0


# ---- invariants -------------------------------------------------------------------------------------------------

def _chain(kv: PagedKV, seq: Sequence, index: int) -> int:
    """The hash the sequence's block `index` is published under, from its tokens."""
    tokens = (seq.prompt_ids + seq.output_ids)[index * kv.block_size:(index + 1) * kv.block_size]
    parent = kv.block_hash[seq.block_table[index - 1]] if index else seq.prefix_key
    return hash((parent, tuple(tokens)))


def check_kv(engine) -> None:
    """The block pool's bookkeeping agrees with the block tables of the running sequences."""
    sched, kv = engine.scheduler, engine.scheduler.kv
    held = Counter(b for seq in sched.running for b in seq.block_table)
    assert all(not seq.block_table for seq in sched.waiting), "a waiting sequence holds blocks"
    assert kv.ref_counts == [held[b] for b in range(kv.capacity)], "reference counts differ from the block tables"
    free = {b for b in range(kv.capacity) if not held[b]}
    assert set(kv.free) == free and len(kv.free) == len(free)
    assert kv.stats.num_used_blocks == kv.capacity - len(free)
    assert set(kv.free_cached) == {b for b in free if kv.block_hash[b] is not None}
    assert all(kv.block_hash[b] == h for h, b in kv.cached.items()), "the cache maps a hash to a block without it"
    assert len(set(kv.cached.values())) == len(kv.cached), "a block is cached under two hashes"
    assert set(kv.reserved_by) == {b for blocks in kv.reservations.values() for b in blocks}
    assert set(kv.reserved_by) <= free, "a held block is still reserved"
    keys = {(s.request_id, s.index) for s in sched.running}
    assert {k for k, blocks in kv.reservations.items() if blocks} <= keys, "a reservation outlived its sequence"
    assert all(kv.open[b] == (b in free and kv.block_hash[b] is None and b not in kv.reserved_by)
               for b in range(kv.capacity)), "open blocks are misfiled"
    for seq in sched.running:
        assert 0 <= seq.num_computed < seq.num_tokens, "a running sequence has nothing left to compute"
        assert len(seq.block_table) * kv.block_size >= seq.num_computed
        assert seq.num_hashed_blocks <= seq.num_computed // kv.block_size
        for index in range(seq.num_hashed_blocks):  # a published block holds the tokens its hash names
            assert kv.block_hash[seq.block_table[index]] == _chain(kv, seq, index), "a cached block's tokens differ"


def check_schedule(engine, chunks: list[ScheduledTokens], decoding: set[int], seen: Counter) -> None:
    """One step's batch keeps the limits, and writes only blocks that its sequence alone holds (`decoding`: the ids
    of the sequences that ran with one token left before the step)."""
    sched, kv = engine.scheduler, engine.scheduler.kv
    assert len(sched.running) <= sched.max_num_seqs and len(chunks) <= sched.max_num_seqs
    assert len({id(c.seq) for c in chunks}) == len(chunks), "a sequence is scheduled twice"
    assert sum(c.num_tokens for c in chunks) <= sched.max_num_batched_tokens
    decodes = [c for c in chunks if id(c.seq) in decoding]
    prompt_tokens = sum(c.num_tokens for c in chunks if id(c.seq) not in decoding)
    if decodes and sched.max_prefill_tokens_while_decoding is not None:
        assert prompt_tokens <= sched.max_prefill_tokens_while_decoding
    for c in chunks:
        seq = c.seq
        assert seq.status is SeqStatus.RUNNING and seq in sched.running
        assert c.num_tokens >= 1, "an empty chunk was scheduled"
        assert c.start + c.num_tokens - len(c.draft) <= seq.num_tokens, "a chunk runs past its sequence's tokens"
        assert len(seq.block_table) * kv.block_size >= c.start + c.num_tokens, "no block for a scheduled position"
        for pos in range(c.start, c.start + c.num_tokens):
            block = seq.block_table[pos // kv.block_size]
            assert kv.ref_counts[block] == 1 and kv.block_hash[block] is None, "a step writes a shared block"
        seen["prompt chunks cut short"] += not c.completes_seq
    seen["steps"] += 1
    check_kv(engine)


def check_idle(engine) -> None:
    """With nothing left to run, every block is free and nothing is held or reserved for anyone."""
    sched, kv = engine.scheduler, engine.scheduler.kv
    assert not sched.running and not sched.waiting and not engine.seqs
    check_kv(engine)
    assert kv.num_free_blocks == kv.capacity and not any(kv.ref_counts) and kv.stats.num_used_blocks == 0
    assert not kv.reserved_by and not any(kv.reservations.values())


# ---- the drive --------------------------------------------------------------------------------------------------

def _state(engine, rid: str) -> str:
    seqs = [s for s in engine.seqs[rid] if not s.is_finished]
    if all(s.status is SeqStatus.WAITING for s in seqs):
        return "queued"
    return "prefill" if any(s.status is SeqStatus.RUNNING and not s.output_ids for s in seqs) else "decode"


def _abort_one(engine, by_id: dict[str, Req], rng: random.Random, seen: Counter) -> None:
    """Abort a request in flight, in a state drawn first (queued requests far outnumber the others, and a prefill
    is over in a few steps: it is drawn more often)."""
    states: dict[str, list[str]] = {}
    for rid in sorted(engine.seqs):
        states.setdefault(_state(engine, rid), []).append(rid)
    state = rng.choices(sorted(states), [3 if s == "prefill" else 1 for s in sorted(states)])[0]
    rid = rng.choice(states[state])
    by_id[rid].aborted_in = state
    seen[f"aborted in {state}"] += 1
    engine.abort(rid)
    check_kv(engine)


def drive(engine, reqs: list[Req], rng: random.Random, abort_rate: float) -> Counter:
    """Run the workload step by step, aborting at random; per-step invariants checked; what was exercised."""
    seen: Counter = Counter()
    schedule = engine.scheduler.schedule

    def checked_schedule():
        decoding = {id(s) for s in engine.scheduler.running if s.num_tokens - s.num_computed == 1}
        chunks = schedule()
        check_schedule(engine, chunks, decoding, seen)
        seen["draft tokens"] += sum(len(c.draft) for c in chunks)
        return chunks

    engine.scheduler.schedule = checked_schedule
    by_id = {r.rid: r for r in reqs}
    pending = sorted(reqs, key=lambda r: r.arrival)
    step = 0
    while pending or engine.has_work():
        while pending and pending[0].arrival <= step:
            req = pending.pop(0)
            engine.add_request(req.rid, req.prompt, req.params, n=req.n)
        if engine.seqs and rng.random() < abort_rate:
            _abort_one(engine, by_id, rng, seen)
        for out in engine.step():
            req = by_id[out.request_id]
            assert req.aborted_in is None, "output for an aborted request"
            req.replies.setdefault(out.index, Reply()).add(out)
        check_kv(engine)
        step += 1
        assert step < 3000, "the engine stopped making progress"  # (a run takes a few hundred)
    check_idle(engine)
    seen["preemptions"] = engine.scheduler.kv.stats.preemptions
    seen["prefix hits"] = engine.scheduler.kv.stats.prefix_hits
    return seen


def check_finish(req: Req, reply: Reply, eos: frozenset[int]) -> None:
    """The finish reason is the one its tokens call for."""
    tokens, params = reply.tokens, req.params
    assert tokens, "a finished reply without a token"
    assert len(tokens) <= params.max_tokens, "the reply went past max_tokens"
    assert len(req.prompt) + len(tokens) <= MAX_MODEL_LEN, "the sequence went past max_model_len"
    ends = [t for t in tokens[:-1] if t in params.stop_token_ids or (t in eos and not params.ignore_eos)]
    assert not ends, "the reply went on past a stop token"
    assert not any(stop in reply.text for stop in params.stop), "the reply went on past a stop string"
    if reply.finish_reason == "length":
        assert len(tokens) == params.max_tokens or len(req.prompt) + len(tokens) == MAX_MODEL_LEN
        assert reply.stop_reason is None
    else:
        assert reply.finish_reason == "stop", reply.finish_reason
        if isinstance(reply.stop_reason, int):
            assert reply.stop_reason in params.stop_token_ids and tokens[-1] == reply.stop_reason
        elif isinstance(reply.stop_reason, str):
            assert reply.stop_reason in params.stop and reply.stop_reason not in reply.text
        else:
            assert tokens[-1] in eos and not params.ignore_eos


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CASES = {  # seed -> engine settings: a pool well under max_num_seqs sequences' worth, so sequences get preempted
    0: dict(policy="fcfs", block_size=8, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=32,
            max_prefill_tokens_while_decoding=None),
    1: dict(policy="priority", block_size=4, num_blocks=44, max_num_seqs=5, max_num_batched_tokens=24,
            max_prefill_tokens_while_decoding=8),
    2: dict(policy="fcfs", block_size=16, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=40,
            max_prefill_tokens_while_decoding=16),
    3: dict(policy="fcfs", block_size=8, num_blocks=20, max_num_seqs=6, max_num_batched_tokens=16,
            max_prefill_tokens_while_decoding=None, speculative=SPEC),
    4: dict(policy="priority", block_size=4, num_blocks=36, max_num_seqs=8, max_num_batched_tokens=32,
            max_prefill_tokens_while_decoding=12, speculative=SPEC),
}


@pytest.mark.parametrize("seed", sorted(CASES))
def test_random_workload_matches_requests_run_alone(tiny_model_dir, runner, tok, seed):
    """A seeded random workload under tight limits: replies as alone, right finishes, sound KV, no leak."""
    case = dict(CASES[seed])
    num_blocks, block_size, policy = case.pop("num_blocks"), case["block_size"], case.pop("policy")
    rng = random.Random(seed)
    refs = References(_engine(tiny_model_dir, runner, tok, enable_prefix_caching=False, max_num_seqs=1,
                              max_num_batched_tokens=64, block_size=block_size))
    reqs = _workload(rng, refs, 60, policy, len(tok))
    expected = {(r.rid, i): refs(r.prompt, r.params, i) for r in reqs
                if _compared(r.params, "speculative" in case) for i in range(r.n)}
    # (the runner's cache is the last engine's: every reference is computed before this one is built)
    engine = _engine(tiny_model_dir, runner, tok, scheduling_policy=policy, **case,
                     kv_cache_gib=num_blocks * block_size * runner.kv_bytes_per_token() / 2**30)
    assert engine.scheduler.kv.capacity == num_blocks
    seen = drive(engine, reqs, rng, abort_rate=0.06)
    num_compared = 0
    for req in reqs:
        for index in range(req.n):
            got, ref = req.replies.get(index, Reply()), expected.get((req.rid, index))
            if req.aborted_in is not None and got.finish_reason is None:  # cut short: the start of its reply
                assert ref is None or ref.tokens[:len(got.tokens)] == got.tokens, (req.rid, index)
                continue
            check_finish(req, got, engine.eos_token_ids)
            if ref is not None:
                assert got.same_as(ref), (req.rid, index, req.params, got, ref)
                num_compared += 1
    # what the workload must have exercised, so that the checks above cannot pass by running less
    assert num_compared >= 30, num_compared
    assert seen["preemptions"] and seen["prefix hits"] and seen["prompt chunks cut short"], seen
    assert seen["aborted in queued"] and seen["aborted in prefill"] and seen["aborted in decode"], seen
    assert seen["draft tokens"] if "speculative" in case else not seen["draft tokens"], seen
