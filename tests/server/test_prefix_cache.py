"""Paged KV with prefix caching: shared blocks, LRU reuse, preemption, and outputs that do not change."""

from __future__ import annotations

import httpx
import pytest

from server.backends.torch_runner import TorchRunner
from server.engine.block_manager import PagedKV
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence
from server.runtime import build_engine, eos_token_ids, load_tokenizer
from support import live_server, tiny_config

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(tokens), SamplingParams(), detok=None)


def _computed(kv: PagedKV, seq: Sequence) -> None:
    """What a forward over the whole prompt does to the bookkeeping."""
    seq.num_computed = seq.num_tokens
    kv.register_full_blocks(seq)


def test_a_shared_prefix_is_shared_and_skipped():
    kv = PagedKV(num_blocks=8, block_size=4)
    first = _seq(list(range(10)))
    kv.admit(first)
    assert first.num_computed == 0 and len(first.block_table) == 3
    _computed(kv, first)
    second = _seq(list(range(8)) + [99, 98, 97])  # same first two blocks, then its own
    kv.admit(second)
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert second.num_computed == 8 and second.num_cached_tokens == 8
    assert [kv.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert kv.stats.prefix_hits == 8 and kv.stats.prefix_queries == 21


def test_never_the_whole_prompt_and_freed_blocks_stay_findable_until_reused():
    kv = PagedKV(num_blocks=4, block_size=4)
    first = _seq(list(range(8)))
    kv.admit(first)
    _computed(kv, first)
    kv.release(first)
    assert kv.num_free_blocks == 4
    again = _seq(list(range(8)))
    kv.admit(again)
    assert again.num_computed == 4  # the last block is recomputed: the newest token must give logits
    kv.release(again)
    # a different prompt that needs every block evicts the cached ones (least recently freed first)
    other = _seq(list(range(100, 116)))
    kv.admit(other)
    assert kv.num_free_blocks == 0 and not kv.cached
    assert _seq(list(range(8))).block_table == [] and not kv.can_admit(_seq(list(range(8))))


def test_the_same_tokens_after_another_prefix_never_hit():
    kv = PagedKV(num_blocks=8, block_size=4)
    first = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.admit(first)
    _computed(kv, first)
    shifted = _seq([0, 0, 0, 0, 5, 6, 7, 8, 9])  # block 2 holds the same tokens, under another parent
    kv.admit(shifted)
    assert shifted.num_computed == 0


def test_freed_uncached_blocks_are_reused_before_untouched_ones():
    kv = PagedKV(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = _seq(list(range(6)))
    kv.admit(first)
    used = set(first.block_table)
    kv.release(first)
    second = _seq(list(range(50, 56)))
    kv.admit(second)
    assert set(second.block_table) == used


def _grow(kv: PagedKV, seq: Sequence, tokens: int) -> None:
    """What decoding `tokens` more tokens does to the block table."""
    for _ in range(tokens):
        seq.output_ids.append(7)
        assert kv.ensure_next_slot(seq)


def test_sequences_grow_into_adjacent_blocks_kept_for_them():
    kv = PagedKV(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first, second = (Sequence(rid, 0, list(range(6)), SamplingParams(max_tokens=10), detok=None) for rid in "ab")
    kv.admit(first)
    kv.admit(second)
    assert first.block_table == [0, 1] and second.block_table == [4, 5]  # 16 tokens at most: 4 blocks each
    _grow(kv, first, 10)
    _grow(kv, second, 10)
    assert first.block_table == [0, 1, 2, 3] and second.block_table == [4, 5, 6, 7]
    kv.release(first)
    assert kv.open[:4].all() and not kv.reserved_by


def test_reserved_room_yields_when_nothing_else_is_free():
    kv = PagedKV(num_blocks=6, block_size=4, enable_prefix_caching=False)
    first = Sequence("a", 0, list(range(4)), SamplingParams(max_tokens=16), detok=None)
    kv.admit(first)  # 1 block, room for 4 more: the whole pool but one
    assert first.block_table == [0] and len(kv.reserved_by) == 4
    other = Sequence("b", 0, list(range(8)), SamplingParams(max_tokens=1), detok=None)
    assert kv.can_admit(other)
    kv.admit(other)  # the one open block, then one taken from first's room
    assert len(other.block_table) == 2 and 5 in other.block_table and kv.num_free_blocks == 3
    _grow(kv, first, 12)  # first still grows: what is left of its room, then anything free
    assert len(first.block_table) == 4 and kv.num_free_blocks == 0
    kv.release(other)
    kv.release(first)
    assert kv.open.all() and not kv.reserved_by and not any(kv.reservations.values())


def test_past_reserved_room_a_new_block_evicts_the_least_recently_freed_cached_one():
    kv = PagedKV(num_blocks=10, block_size=4)
    one_token = SamplingParams(max_tokens=1)
    old, recent = (Sequence(rid, 0, list(tokens), one_token, detok=None)
                   for rid, tokens in (("old", range(8)), ("recent", range(20, 28))))
    for seq in (old, recent):  # two hashed blocks each, then freed: old's first (each tail block first)
        kv.admit(seq)
        _computed(kv, seq)
    assert old.block_table == [0, 1] and recent.block_table == [3, 4]
    kv.release(old)
    kv.release(recent)
    grower = Sequence("g", 0, list(range(40, 44)), SamplingParams(max_tokens=200), detok=None)
    kv.admit(grower)  # a block and the room after it, which the free list holds ahead of the cached blocks
    assert grower.block_table == [5] and sorted(kv.reserved_by) == [6, 7, 8]
    newcomer = Sequence("n", 0, list(range(60, 72)), one_token, detok=None)
    kv.admit(newcomer)  # the two open blocks, then past the reserved room the least recently freed cached one
    assert newcomer.block_table == [2, 9, 1]
    last = Sequence("l", 0, list(range(80, 88)), one_token, detok=None)
    kv.admit(last)
    assert last.block_table == [0, 4] and list(kv.cached.values()) == [3] and sorted(kv.reserved_by) == [6, 7, 8]
    out_of_room = Sequence("o", 0, list(range(90, 98)), one_token, detok=None)
    kv.admit(out_of_room)  # the last cached block, then reserved room yields
    assert out_of_room.block_table == [3, 6] and not kv.cached and sorted(kv.reserved_by) == [7, 8]


def test_prefix_caching_off_shares_nothing():
    kv = PagedKV(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = _seq(list(range(10)))
    kv.admit(first)
    _computed(kv, first)
    second = _seq(list(range(10)))
    kv.admit(second)
    assert second.num_computed == 0 and not set(first.block_table) & set(second.block_table)


def _engine(tiny_model_dir, tok, **engine):
    runner = TorchRunner(tiny_model_dir, 256, "float32", num_threads=1)
    runner.load()
    cfg = tiny_config(tiny_model_dir, max_model_len=256, **engine)
    return build_engine(cfg, runner, tok, eos_token_ids(tiny_model_dir, tok))


def _run(engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
    out = {rid: [] for rid in prompts}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return out


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_cached_prefix_gives_the_same_tokens(tiny_model_dir, tok):
    prompt = list(range(100, 150))
    cold = _run(_engine(tiny_model_dir, tok, enable_prefix_caching=False), {"a": prompt}, 12)["a"]
    engine = _engine(tiny_model_dir, tok)
    first = _run(engine, {"a": prompt}, 12)["a"]
    engine.add_request("b", prompt, SamplingParams(max_tokens=12, **GREEDY))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert first == cold and [t for o in outs for t in o.token_ids] == cold
    assert outs[-1].num_cached_tokens == 48  # three 16-token blocks of 50 prompt tokens
    assert engine.scheduler.kv.stats.prefix_hits == 48


def test_out_of_blocks_preempts_and_recomputes_with_the_same_results(tiny_model_dir, tok):
    prompts = {f"r{i}": list(range(200 + 7 * i, 240 + 7 * i)) for i in range(4)}
    roomy = _run(_engine(tiny_model_dir, tok, enable_prefix_caching=False), prompts, 30)
    # 4 sequences of 40 + 30 tokens need 20 blocks of 16; give 17 (one sequence's worth is 16 blocks: max_model_len)
    tight = _engine(tiny_model_dir, tok, enable_prefix_caching=False, max_num_seqs=4, block_size=16,
                    kv_cache_gib=17 * 16 * 2 * 2 * 2 * 16 * 4 / 2**30)
    assert tight.scheduler.kv.capacity == 17
    assert _run(tight, prompts, 30) == roomy
    assert tight.scheduler.kv.stats.preemptions >= 1
    assert tight.scheduler.kv.num_free == tight.scheduler.kv.capacity


def test_an_aborted_request_returns_its_blocks(tiny_model_dir, tok):
    engine = _engine(tiny_model_dir, tok)
    engine.add_request("long", list(range(100, 180)), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.scheduler.kv.num_free < engine.scheduler.kv.capacity
    engine.abort("long")
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.capacity


def test_the_choices_of_an_n_request_compute_its_prompt_once(tiny_model_dir, tok):
    """n = 4 over a 100-token prompt: the first choice computes it, the others take its 6 full blocks from the
    cache and compute the last 4 tokens; their tokens are those of four separate requests (seeded, sampled)."""
    prompt = list(range(300, 400))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)

    def run(engine, n: int) -> tuple[list[list[int]], int]:
        engine.add_request("r", prompt, params, n=n)
        got = {i: [] for i in range(n)}
        while engine.has_work():
            for out in engine.step():
                got[out.index].extend(out.token_ids)
        return [got[i] for i in range(n)], engine.scheduler.kv.stats.prefix_hits

    engine = _engine(tiny_model_dir, tok)
    prompt_tokens = []
    engine.observers.append(lambda stats: prompt_tokens.append(stats.num_prompt_tokens))
    shared, hits = run(engine, 4)
    assert sum(prompt_tokens) == 100 + 3 * 4 and hits == 3 * 96
    cold = _engine(tiny_model_dir, tok, enable_prefix_caching=False)
    assert run(cold, 4)[0] == shared  # the same tokens, each choice seeded by its index


def test_chat_requests_share_their_system_prompt(tiny_model_dir):
    system = {"role": "system", "content": "You are a careful assistant who answers in one short sentence. " * 3}
    with live_server(tiny_config(tiny_model_dir, max_model_len=512)) as live:
        usages = []
        for question in ("What is the capital of France?", "Name a prime number."):
            body = {"model": "tiny", "messages": [system, {"role": "user", "content": question}], "max_tokens": 3}
            usages.append(httpx.post(f"{live.url}/v1/chat/completions", json=body).json()["usage"])
        usages.append(httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": "tiny", "n": 3, "max_tokens": 2, "messages": [{"role": "user", "content": "A fresh question " * 9}],
        }).json()["usage"])
        metrics = httpx.get(f"{live.url}/metrics").text
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert usages[2]["prompt_tokens_details"]["cached_tokens"] == 0  # its choices share what its first computed
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 32
    assert "vllm:kv_cache_usage_perc" in metrics and "vllm:num_preemptions_total" in metrics


@pytest.mark.slow
def test_smollm2_greedy_text_is_the_same_from_the_prefix_cache(smol_dir):
    """The real model: a prompt served again from cached blocks continues with the same greedy tokens."""
    tok = load_tokenizer(smol_dir)
    runner = TorchRunner(smol_dir, 512, "float32")
    runner.load()
    engine = build_engine(tiny_config(smol_dir, max_model_len=512), runner, tok, eos_token_ids(smol_dir, tok))
    prompt = tok("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
                 "combined movable metal type with an oil-based ink and a screw press. Within fifty years").input_ids
    first = _run(engine, {"cold": prompt}, 24)["cold"]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=24, **GREEDY))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].num_cached_tokens >= 32
    assert [t for o in outs for t in o.token_ids] == first


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(tiny_model_dir):
    """vLLM's cache_salt: the same prompt under another salt (or none) finds nothing cached; under its own, its
    blocks; the answer is the same either way."""
    tok = load_tokenizer(tiny_model_dir)
    runner = TorchRunner(tiny_model_dir, 256, "float32")
    runner.load()
    engine = build_engine(tiny_config(tiny_model_dir), runner, tok, eos_token_ids(tiny_model_dir, tok))
    prompt = list(range(100, 140))

    def run(rid: str, salt: str | None) -> tuple[list[int], int]:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, cache_salt=salt))
        hits = engine.scheduler.kv.stats.prefix_hits
        tokens = []
        while engine.has_work():
            tokens += [t for out in engine.step() for t in out.token_ids]
        return tokens, engine.scheduler.kv.stats.prefix_hits - hits

    first, _ = run("a", "tenant-1")
    assert run("b", None) == (first, 0) and run("c", "tenant-2") == (first, 0)
    assert run("d", "tenant-1") == (first, 32)
