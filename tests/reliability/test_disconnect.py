"""200 clients hang up at random points (queued, prefill, decode): every KV slot comes back, nothing leaks,
and the next request gets the same greedy text at comparable speed."""

from __future__ import annotations

import asyncio
import collections
import random
import statistics
import time

import httpx
import pytest

from server.engine.sequence import SeqStatus
from support import live_server, tiny_config

pytestmark = pytest.mark.slow

NUM_CLIENTS = 200
PREFILL_WATCHED = (100, 101, 102)  # token ids of the prompts that hang up mid-prefill, one each
DECODE_WATCHED = 103  # the prompt that hangs up mid-decode: random delays alone miss decode on a fast engine
PROBE = {"model": "tiny", "prompt": "The probe request", "max_tokens": 48, "temperature": 0, "ignore_eos": True}


def _recording_loader(phases: collections.Counter):
    """load_runtime, with engine.abort counting where each aborted sequence was."""
    from server.runtime import load_runtime

    def loader(cfg):
        runtime = load_runtime(cfg)
        engine = runtime.engine
        original = engine.abort

        def abort(request_id: str) -> int:
            for seq in engine.seqs.get(request_id, []):
                if seq.status is SeqStatus.WAITING:
                    phases["queued"] += 1
                elif seq.status is SeqStatus.RUNNING:
                    phases["prefill" if seq.num_computed < len(seq.prompt_ids) else "decode"] += 1
            return original(request_id)

        engine.abort = abort
        execute = runtime.runner.execute

        def slow_long_prefill(chunks):
            # the tiny model prefills 950 tokens in a blink; 60 chunks x 5 ms leave the hang-up time to land
            if any(not c.needs_logits and set(c.token_ids) <= set(PREFILL_WATCHED) for c in chunks):
                time.sleep(0.005)
            return execute(chunks)

        runtime.runner.execute = slow_long_prefill
        return runtime

    return loader


async def _client(url: str, rng: random.Random, outcomes: collections.Counter) -> None:
    """One client that hangs up after a random delay, streaming or not, with a short or long prompt."""
    words = rng.choice([4, 120, 800, 800])  # 800 words take ~50 16-token prefill chunks
    body = {"model": "tiny", "prompt": " ".join(["tick"] * words), "max_tokens": rng.choice([8, 100]),
            "ignore_eos": True, "stream": rng.random() < 0.5}
    delay = rng.uniform(0.3, 5.0)  # long enough to reach the server; most are still queued then
    async with httpx.AsyncClient(timeout=60) as client:  # one connection per client: closing it is the hang-up
        try:
            async with asyncio.timeout(delay):
                if body["stream"]:
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                else:
                    await client.post(f"{url}/v1/completions", json=body)
            outcomes["finished before hang-up"] += 1
        except TimeoutError:
            outcomes["hung up"] += 1


async def _hang_up_watched(url: str, scheduler, token_id: int, phase: str) -> None:
    """A client whose prompt is watched in the engine: it hangs up mid-prefill or mid-decode (timing-independent).

    Each call needs its own prompt: the prefix cache would serve a repeated one without a prefill."""
    prompt_len = 950 if phase == "prefill" else 8
    body = {"model": "tiny", "prompt": [token_id] * prompt_len, "max_tokens": 8 if phase == "prefill" else 900,
            "ignore_eos": True, "stream": True}

    def reached(s) -> bool:
        if phase == "prefill":
            return 0 < s.num_computed < len(s.prompt_ids)
        return s.num_computed > len(s.prompt_ids)  # at least one generated token fed back

    async def send():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_lines():
                    pass

    task = asyncio.ensure_future(send())
    deadline = time.monotonic() + 30
    while not any(s.prompt_ids[0] == token_id and reached(s) for s in list(scheduler.running)):
        assert time.monotonic() < deadline and not task.done(), f"never saw the {phase}"
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _probe(url: str) -> tuple[str, float]:
    start = time.monotonic()
    resp = httpx.post(f"{url}/v1/completions", json=PROBE, timeout=60)
    assert resp.status_code == 200
    return resp.json()["choices"][0]["text"], time.monotonic() - start


def _wait_released(state, timeout: float = 20.0) -> None:
    engine = state.runtime.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.scheduler.has_work() and not engine.seqs and state.engine.num_in_flight == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not released: waiting={engine.scheduler.num_waiting} running={engine.scheduler.num_running}"
                         f" seqs={len(engine.seqs)} in_flight={state.engine.num_in_flight}")


def test_random_disconnects_free_every_slot(tiny_model_dir):
    phases: collections.Counter = collections.Counter()
    cfg = tiny_config(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=1024,
                      max_queue=NUM_CLIENTS)
    with live_server(cfg, _recording_loader(phases)) as live:
        text_before, times = None, []
        for _ in range(3):
            text_before, elapsed = _probe(live.url)
            times.append(elapsed)
        time_before = statistics.median(times)

        outcomes: collections.Counter = collections.Counter()
        rng = random.Random(0)

        async def storm():
            scheduler = live.state.runtime.engine.scheduler
            for token_id in PREFILL_WATCHED:
                await _hang_up_watched(live.url, scheduler, token_id, "prefill")
            await _hang_up_watched(live.url, scheduler, DECODE_WATCHED, "decode")
            await asyncio.gather(*(_client(live.url, rng, outcomes) for _ in range(NUM_CLIENTS)))

        asyncio.run(storm())
        assert sum(outcomes.values()) == NUM_CLIENTS
        _wait_released(live.state)

        slots = live.state.runtime.engine.scheduler.kv
        assert slots.num_free == slots.capacity
        metrics = httpx.get(f"{live.url}/metrics").text
        assert "neuronmm_num_requests_running{model_name=\"tiny\"} 0.0" in metrics
        assert "neuronmm_num_requests_waiting{model_name=\"tiny\"} 0.0" in metrics
        # the storm really cut requests off in every phase
        # (prefill and decode are forced by the watched prompts; the queued count is the storm's, 8-18 in six runs)
        assert phases["queued"] >= 3 and phases["prefill"] >= 2 and phases["decode"] >= 1, phases
        assert outcomes["hung up"] >= NUM_CLIENTS // 2, outcomes

        times = []
        for _ in range(3):
            text_after, elapsed = _probe(live.url)
            times.append(elapsed)
            assert text_after == text_before  # no stale KV state leaks into a reused slot
        time_after = statistics.median(times)
        print(f"\nengine phase at hang-up: {dict(phases)} (the rest hung up before the engine saw them); "
              f"clients: {dict(outcomes)}; "
              f"probe {time_before * 1000:.0f} ms before, {time_after * 1000:.0f} ms after")
        assert time_after < 2 * time_before + 0.1
