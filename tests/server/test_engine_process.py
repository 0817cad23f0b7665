"""The engine core in its own process (how `neuronmm serve` runs): same answers, aborts, metrics, death."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import os
import pickle
import signal
import time
from contextlib import contextmanager

import httpx
import psutil
import pytest

from server.engine.core_process import core_main
from server.engine.async_engine import QueueFullError
from server.engine.engine_core import AddRequest, EngineCoreClient, StepReport
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import SeqOutput, TokenLogprob
from server.engine.step_stats import KVStats, LoraStats, StepStats
from support import live_server, tiny_config


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """An app serving from a core spawned before it, as `neuronmm serve` starts them (the core loads meanwhile); 1,024
    positions, for the pipe buffer test's prompt."""
    cfg = tiny_config(tiny_model_dir, max_model_len=1024)
    core = EngineCoreClient(cfg)
    core.spawn()
    with live_server(cfg, engine_process=True, engine_core=core, ready_timeout=120) as live:
        live.core = core
        yield live


def _complete(url: str, **body) -> dict:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()


def _stream_text(url: str, **body) -> str:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": True, **body}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(text)


def test_a_step_report_crosses_the_pipe_as_tuples_and_comes_back_whole():
    """Every field of every record survives the wire form, and the wire holds no dataclass (unpickling one is the
    class lookup the tuples avoid)."""
    logprobs = [TokenLogprob(5, -0.25, [(5, -0.25), (7, -1.5)], rank=1)]
    outputs = [SeqOutput("r-1", 1, " hi", [5], logprobs, "stop", 4, 2, None, 3, [None, logprobs[0]], (2, 1), None,
                         "</s>"),
               SeqOutput("r-2", 0, "", [], None, None, 9, 0, "engine error: x", embedding=[0.5, -1.0])]
    stats = StepStats(2, 9, 1, [0.1], [0.01], [0.02], [("stop", 1.5)], 4, 3, KVStats(64, 10, 100, 40, 1),
                      {("decode", 8): 3}, LoraStats(("a",), ("b", "c"), 2))
    for report in (StepReport(outputs, stats, 1, 2, 3, 4, 5), StepReport([], None, 0, 0, 0)):
        wire = report.to_wire()
        assert StepReport.from_wire(pickle.loads(pickle.dumps(wire))) == report

        def records(value):
            if dataclasses.is_dataclass(value):
                yield value
            elif isinstance(value, (list, tuple)):
                for item in value:
                    yield from records(item)
        assert {type(r) for r in records(wire)} <= {TokenLogprob}  # (logprobs stay records: only when asked)


def test_requests_still_on_their_way_to_the_core_count_against_the_queue(tiny_model_dir):
    """Admission counts what the core says waits plus what it has not read yet: a report sent while the core was
    mid-step (it has read one add of two) must not forget the other (the queue could reach ~2 x max_queue)."""
    client = EngineCoreClient(tiny_config(tiny_model_dir, max_queue=2))
    sent = []
    client._proc = type("Alive", (), {"is_alive": lambda self: True})()
    client._reading, client._send = True, sent.append

    async def main():
        params = SamplingParams(max_tokens=1)
        client.submit([1], params, request_id="a"), client.submit([2], params, request_id="b")
        with pytest.raises(QueueFullError):
            client.submit([3], params)
        client._deliver(StepReport([], None, 1, 0, 1, num_added=1))  # "a" waits in the core, "b" is in transit
        with pytest.raises(QueueFullError):
            client.submit([3], params)
        client._deliver(StepReport([], None, 1, 1, 1, num_added=2))  # "a" runs, "b" waits
        client.submit([3], params, request_id="c")
        assert [message[1].request_id for message in sent] == ["a", "b", "c"]

    asyncio.run(main())


def test_runs_in_another_process(server):
    assert server.state.runtime is None  # no model in the API process
    assert server.state.engine._proc.pid and server.state.engine.is_alive
    # the core spawned before the app is the one it serves from: no second core
    assert server.state.engine is server.core
    assert [p.name for p in mp.active_children()].count("neuronmm-engine-core") == 1


def test_streamed_equals_full_and_seeded_sampling_repeats(server):
    full = _complete(server.url)
    assert full["usage"]["completion_tokens"] == 12
    assert _stream_text(server.url) == full["choices"][0]["text"]
    sampled = [_complete(server.url, temperature=1.0, seed=7, n=2)["choices"] for _ in range(2)]
    assert [c["text"] for c in sampled[0]] == [c["text"] for c in sampled[1]]


def test_concurrent_requests_batch_and_metrics_cross_the_process(server):
    async def many():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(many())
    assert all(r.status_code == 200 for r in responses)
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # batching keeps greedy results
    metrics = httpx.get(f"{server.url}/metrics").text
    generated = [line for line in metrics.splitlines() if line.startswith("neuronmm_generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) >= 48


def test_metrics_export_the_engine_core_process(server):
    """`process_*` describe the API process; the core's own CPU and memory come as neuronmm_engine_core_process_*."""
    samples = {line.split()[0]: float(line.split()[-1]) for line in httpx.get(f"{server.url}/metrics").text.splitlines()
               if line and not line.startswith("#")}
    core_rss = psutil.Process(server.state.engine.pid).memory_info().rss
    assert server.state.engine.pid != os.getpid()
    assert abs(samples["neuronmm_engine_core_process_resident_memory_bytes"] - core_rss) < 0.1 * core_rss
    assert samples["neuronmm_engine_core_process_cpu_seconds_total"] > 0
    api_rss = psutil.Process().memory_info().rss
    assert abs(samples["process_resident_memory_bytes"] - api_rss) < 0.1 * api_rss


def test_disconnect_mid_stream_aborts_and_the_engine_keeps_serving(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 10
    while server.state.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.engine.num_running == 0
    assert _complete(server.url)["usage"]["completion_tokens"] == 12


def test_engine_death_fails_requests_and_health(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir, max_model_len=256), engine_process=True, ready_timeout=120) as live:
        live.state.engine._proc.kill()
        live.state.engine._proc.join(10)
        deadline = time.monotonic() + 10
        while live.state.engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{live.url}/health").status_code == 503
        resp = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["message"]


@contextmanager
def _spawned_core(cfg):
    """The engine core alone, as EngineCoreClient.spawn starts it: (process, our end of its pipe) once it is ready;
    killed on the way out if still running."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=core_main, args=(cfg, theirs), daemon=True)
    proc.start()
    theirs.close()
    try:
        assert ours.poll(120), "the engine core did not come up"
        assert ours.recv() == ("ready", None)
        yield proc, ours
    finally:
        if proc.is_alive():
            proc.kill()


def test_the_core_leaves_shutdown_to_the_api(tiny_model_dir):
    """Ctrl+C in a terminal (and a service manager's SIGTERM to the group) reach the core too: it keeps serving, so
    the API can drain its requests, and exits cleanly when told to stop."""
    with _spawned_core(tiny_config(tiny_model_dir, max_model_len=256)) as (proc, conn):
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGTERM)
        conn.send(("add", AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 1)))
        tokens, finished = [], False
        while not finished:
            assert conn.poll(30), "no step report"
            for out in StepReport.from_wire(conn.recv()[1]).outputs:
                if out.request_id == "r":
                    tokens += out.token_ids
                    finished = out.finish_reason is not None
        assert len(tokens) == 4 and proc.is_alive()
        conn.send(("stop", None))
        proc.join(30)
        assert proc.exitcode == 0


def test_the_core_exits_when_the_api_is_gone(tiny_model_dir):
    """A killed API process closes its end of the pipe: the core exits by itself, without a traceback (code 0)."""
    with _spawned_core(tiny_config(tiny_model_dir, max_model_len=256)) as (proc, conn):
        conn.close()
        proc.join(30)
        assert proc.exitcode == 0


def test_a_spawned_core_ignores_signals_from_its_first_instant(tiny_model_dir):
    """spawn() starts the core with SIGINT and SIGTERM blocked, before its imports (a Ctrl+C while the server starts
    reaches it too); it comes up, and stop() ends it cleanly."""
    client = EngineCoreClient(tiny_config(tiny_model_dir, max_model_len=256))
    loop = asyncio.new_event_loop()
    client.spawn()
    try:
        os.kill(client._proc.pid, signal.SIGINT)
        os.kill(client._proc.pid, signal.SIGTERM)
        client.wait_ready(loop, timeout_s=120)
        assert client._proc.is_alive()
    finally:
        client.stop()
        loop.close()
    assert client._proc.exitcode == 0


def test_stopping_a_core_that_is_still_loading_kills_it_at_once(tiny_model_dir):
    """Nothing to drain, and it reads no message until it is ready: stop() does not wait out its timeout."""
    client = EngineCoreClient(tiny_config(tiny_model_dir, max_model_len=256))
    client.spawn()
    start = time.monotonic()
    client.stop(timeout=30)
    assert client._proc.exitcode == -signal.SIGKILL and time.monotonic() - start < 10



def test_a_report_larger_than_the_pipe_buffer_reaches_its_request(server):
    """A step report past the socket's buffer (prompt logprobs over a 1,000-token prompt: ~0.3 MB) arrives whole,
    and the core serves on: under uvloop, whose reader makes the socket non-blocking, Connection.recv once read such
    a report as the core's death and failed every request after it."""
    prompt = [1000 + 37 * i % 40000 for i in range(1000)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20, "temperature": 0}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["prompt_logprobs"]) == 1000
    assert server.core.is_alive
    assert _complete(server.url)["choices"][0]["finish_reason"] == "length"
