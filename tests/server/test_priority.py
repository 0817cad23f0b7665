"""vLLM's priority scheduling: lower `priority` first, then arrival; it preempts later priorities for room."""

from __future__ import annotations

import httpx
import pytest

from server.engine.block_manager import PagedKV
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, SeqStatus
from support import live_server, tiny_config


def _seq(rid: str, priority: int, tokens: int = 8) -> Sequence:
    return Sequence(rid, 0, list(range(100, 100 + tokens)), SamplingParams(max_tokens=4, priority=priority),
                    detok=None)


def _admitted(scheduler: Scheduler) -> list[str]:
    chunks = scheduler.schedule()
    started = [c.seq.request_id for c in chunks if c.start == 0]
    scheduler.mark_computed(chunks)
    return started


def test_the_queue_runs_by_priority_then_arrival():
    scheduler = Scheduler(1, 64, PagedKV(64, 16, enable_prefix_caching=False), policy="priority")
    for rid, priority in (("late-5", 5), ("a-1", 1), ("b-3", 3), ("c-1", 1)):
        scheduler.add(_seq(rid, priority))
    order = []
    while scheduler.waiting:
        order += _admitted(scheduler)
        for seq in list(scheduler.running):
            scheduler.finish(seq, "stop")
    assert order == ["a-1", "c-1", "b-3", "late-5"]
    fcfs = Scheduler(4, 64, PagedKV(64, 16, enable_prefix_caching=False))
    for rid, priority in (("late-5", 5), ("a-1", 1)):
        fcfs.add(_seq(rid, priority))
    assert _admitted(fcfs) == ["late-5", "a-1"]  # the default policy keeps arrival order


def test_an_earlier_priority_preempts_a_later_one_for_room():
    scheduler = Scheduler(1, 64, PagedKV(64, 16, enable_prefix_caching=False), policy="priority")
    low = _seq("low", 9)
    scheduler.add(low)
    assert _admitted(scheduler) == ["low"]
    urgent = _seq("urgent", 0)
    scheduler.add(urgent)
    assert _admitted(scheduler) == ["urgent"]  # the running low-priority sequence made room
    assert low.status is SeqStatus.WAITING and low.num_computed == 0 and scheduler.waiting[0] is low
    scheduler.finish(urgent, "stop")
    assert _admitted(scheduler) == ["low"]  # recomputed once room is back
    same = Scheduler(1, 64, PagedKV(64, 16, enable_prefix_caching=False), policy="priority")
    first, second = _seq("first", 2), _seq("second", 2)
    same.add(first)
    _admitted(same)
    same.add(second)
    assert _admitted(same) == [] and first.status is SeqStatus.RUNNING  # an equal priority waits its turn


def test_served_priority_needs_the_policy(tiny_model_dir):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "priority": -3}
    with live_server(tiny_config(tiny_model_dir)) as live:
        resp = httpx.post(f"{live.url}/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
        assert httpx.post(f"{live.url}/v1/completions", json={**body, "priority": 0}).status_code == 200
    cfg = tiny_config(tiny_model_dir)
    cfg.engine.scheduling_policy = "priority"
    with live_server(cfg) as live:
        assert httpx.post(f"{live.url}/v1/completions", json=body).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 4}
        assert httpx.post(f"{live.url}/v1/chat/completions", json=chat).status_code == 200


def test_out_of_blocks_preempts_the_latest_priority_not_the_newest():
    scheduler = Scheduler(4, 64, PagedKV(64, 16, enable_prefix_caching=False), policy="priority")
    for rid, priority in (("p0", 0), ("p5", 5), ("p1", 1)):
        scheduler.add(_seq(rid, priority))
    _admitted(scheduler)
    assert [s.request_id for s in scheduler.running] == ["p0", "p1", "p5"]
    assert scheduler._victim().request_id == "p5"
    fcfs = Scheduler(4, 64, PagedKV(64, 16, enable_prefix_caching=False))
    for rid, priority in (("p0", 0), ("p5", 5), ("p1", 1)):
        fcfs.add(_seq(rid, priority))
    _admitted(fcfs)
    assert fcfs._victim().request_id == "p1"  # the newest
