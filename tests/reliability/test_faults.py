"""Engine faults beyond tests/server/test_api.py: a failing step fails only the requests in it (500 or an
error chunk) while queued requests run next; faults in the sampler and outside step() alike; the loop lives."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

import server.engine.llm_engine as llm_engine_module
from server.backends.base import SeqChunk
from support import live_server, refuse_prompts_starting, tiny_config, wait_for

POISON_TOKEN = 7
MAX_TOKENS = 12


class _PoisonRunner:
    """Raises inside execute() for a sequence whose prompt starts with POISON_TOKEN, once two requests queue."""

    def __init__(self, inner, scheduler):
        self.inner = inner
        self.scheduler = scheduler
        self.poisoned: set[int] = set()
        self.faults = 0

    def execute(self, chunks: list[SeqChunk]):
        for c in chunks:
            if c.start_pos == 0:
                self.poisoned.discard(c.slot)
                if c.token_ids[0] == POISON_TOKEN:
                    self.poisoned.add(c.slot)
            elif c.slot in self.poisoned and self.scheduler.num_waiting >= 2:
                self.poisoned.discard(c.slot)
                self.faults += 1
                raise RuntimeError("injected forward fault")
        return self.inner.execute(chunks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    from server.runtime import load_runtime

    def loader(cfg):
        runtime = load_runtime(cfg)
        runtime.engine.runner = _PoisonRunner(runtime.engine.runner, runtime.engine.scheduler)
        return runtime

    cfg = tiny_config(tiny_model_dir, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512)
    with live_server(cfg, loader) as server:
        yield server


def _running(live) -> int:
    return live.state.runtime.engine.scheduler.num_running


def _waiting(live) -> int:
    return live.state.runtime.engine.scheduler.num_waiting


def _complete(live, prompt, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)


def _scenario(live, poison: dict):
    """A streaming bystander and a poisoned request share the batch; two more wait for a slot.

    Returns (poisoned response, bystander SSE events, the two queued responses)."""
    long_body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 400, "ignore_eos": True, "stream": True}
    pool = concurrent.futures.ThreadPoolExecutor(4)

    def stream():
        with httpx.stream("POST", f"{live.url}/v1/completions", json=long_body, timeout=60) as r:
            return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    bystander = pool.submit(stream)
    wait_for(lambda: _running(live) == 1)
    # both slots busy; the fault fires only once the two queued requests are waiting (not in the step)
    poisoned = pool.submit(_complete, live, max_tokens=400, **poison)
    wait_for(lambda: _running(live) == 2)
    queued = [pool.submit(_complete, live, [20 + i, 21, 22]) for i in range(2)]
    results = poisoned.result(), bystander.result(), [q.result() for q in queued]
    pool.shutdown()
    resp = results[0]
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error", resp.text[:300]
    return results


def _assert_only_the_step_failed(live, results) -> None:
    _, events, queued = results
    # the bystander was in the failing step: tokens, then an error chunk, then [DONE]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert "choices" in json.loads(events[0])
    for resp in queued:  # not in the step: served in full
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    wait_for(lambda: _running(live) == 0 and _waiting(live) == 0)
    slots = live.state.runtime.engine.scheduler.kv
    assert slots.num_free == slots.capacity and live.state.engine.is_alive


def test_forward_fault_fails_only_its_step(live):
    runner = live.state.runtime.engine.runner
    before = runner.faults
    results = _scenario(live, {"prompt": [POISON_TOKEN, 8, 9]})
    assert runner.faults == before + 1
    assert "injected forward fault" in results[0].json()["error"]["message"]
    _assert_only_the_step_failed(live, results)


def test_sampler_fault_fails_only_its_step(live, monkeypatch):
    real = llm_engine_module.sample

    def sample(logits, seqs):
        if any(s.params.seed == 4242 for s in seqs) and live.state.runtime.engine.scheduler.num_waiting >= 2:
            raise FloatingPointError("injected sampler fault")
        return real(logits, seqs)

    monkeypatch.setattr(llm_engine_module, "sample", sample)
    results = _scenario(live, {"prompt": [30, 31, 32], "seed": 4242, "temperature": 1.0})
    assert "injected sampler fault" in results[0].json()["error"]["message"]
    _assert_only_the_step_failed(live, results)


def test_fault_outside_the_step_fails_the_batch_not_the_queue(live, monkeypatch):
    real = llm_engine_module.LLMEngine._finish_reason

    def finish_reason(self, seq, token):
        if "POISON" in seq.params.stop and self.scheduler.num_waiting >= 2:
            raise KeyError("injected bookkeeping fault")
        return real(self, seq, token)

    monkeypatch.setattr(llm_engine_module.LLMEngine, "_finish_reason", finish_reason)
    results = _scenario(live, {"prompt": [40, 41, 42], "stop": ["POISON"]})
    assert results[0].json()["error"]["message"] == "engine step failed"
    _assert_only_the_step_failed(live, results)


def test_server_serves_normally_after_the_faults(live):
    resp = _complete(live, "all good")
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}


def test_request_the_engine_cannot_add_fails_alone(live, monkeypatch):
    refuse_prompts_starting(monkeypatch, [50, 51])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad, good1, good2 = pool.map(lambda p: _complete(live, p), [[50, 51, 52], [60, 61], [62, 63]])
    assert bad.status_code == 500 and "injected admission fault" in bad.json()["error"]["message"]
    assert good1.status_code == 200 and good2.status_code == 200
    assert live.state.engine.is_alive
