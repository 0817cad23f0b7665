"""Request lifecycle when things fail: a prompt of a batch that fails, an engine loop or core that dies, a pipe that
breaks as a request is sent. Each in-flight request ends with an OpenAI error (none waits forever), nothing is left
behind for it (readers, routes), and /metrics goes back to idle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

import httpx
import pytest

import server.engine.llm_engine as llm_engine_module
from server.api.errors import APIError
from server.api.serving import OpenAIServing
from server.engine.async_engine import RequestStream
from server.engine.engine_core import EngineCoreClient
from server.engine.sampling_params import SamplingParams
from support import live_server, refuse_prompts_starting, tiny_config

LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True}


class _Releases:
    """An engine's release(), recorded."""

    def __init__(self):
        self.released: list[tuple[str, bool]] = []

    def release(self, request_id: str, abort: bool) -> None:
        self.released.append((request_id, abort))


def test_closing_a_stream_ends_a_read_another_task_awaits():
    """A sibling prompt's reader, still waiting when the request is given up, ends instead of waiting forever."""
    async def main():
        engine = _Releases()
        stream = RequestStream(engine, "r", asyncio.Queue(), 1)
        reader = asyncio.ensure_future(anext(stream, "ended"))
        await asyncio.sleep(0)
        await stream.aclose()
        assert await asyncio.wait_for(reader, 1) == "ended"
        assert engine.released == [("r", True)]

    asyncio.run(main())


async def _asgi_post(app, path: str, body: dict) -> tuple[int, dict]:
    """POST through the app's ASGI interface in this loop (its client never leaves): (status, JSON body)."""
    raw, sent = json.dumps(body).encode(), []
    messages = iter([{"type": "http.request", "body": raw, "more_body": False}])

    async def receive():
        return next(messages, None) or await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_a_failed_prompt_leaves_no_reader_of_the_others_behind(tiny_model_dir, monkeypatch):
    """Two prompts, the first refused by the engine: a 500, the second aborted, and no task left waiting on it (one
    leaked a pending task, and its queue, per such request)."""
    refuse_prompts_starting(monkeypatch, [50, 51])
    with live_server(tiny_config(tiny_model_dir, max_model_len=512)) as live:
        async def main():
            body = {"model": "tiny", "prompt": [[50, 51, 52], [60, 61]], "max_tokens": 200, "ignore_eos": True}
            status, reply = await _asgi_post(live.app, "/v1/completions", body)
            assert status == 500 and "injected admission fault" in reply["error"]["message"]
            for _ in range(20):
                await asyncio.sleep(0.01)
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

        assert asyncio.run(main()) == []
        assert live.state.engine.num_in_flight == 0


def _metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(name + "{"))
    return float(line.split()[-1])


def _stream_lines(url: str) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=15) as resp:
        return [line for line in resp.iter_lines() if line]


def _assert_failed_cleanly(url: str, full: httpx.Response, lines: list[str]) -> None:
    """The in-flight requests ended with OpenAI errors; the server says it cannot serve, and shows nothing running."""
    assert full.status_code == 500 and full.json()["error"]["code"] == "engine_error"
    assert json.loads(lines[-2][6:])["error"]["code"] == "engine_error" and lines[-1] == "data: [DONE]"
    assert httpx.get(f"{url}/health").status_code == 503
    late = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=15)
    assert late.status_code == 503 and late.json()["error"]["message"]
    assert _metric(url, "neuronmm_num_requests_running") == 0
    assert _metric(url, "neuronmm_num_requests_waiting") == 0


def _with_requests_in_flight(url: str, running, kill) -> tuple[httpx.Response, list[str]]:
    """A streamed and a full LONG request, and `kill()` once the engine runs both: what each got."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_lines, url)
        full = pool.submit(lambda: httpx.post(f"{url}/v1/completions", json=LONG, timeout=15))
        deadline = time.monotonic() + 10
        while running() < 2:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.005)
        kill()
        return full.result(), streamed.result()


def test_an_engine_loop_that_fails_fails_its_requests(tiny_model_dir, monkeypatch):
    """A bug outside step() (here in abort) stops the engine thread: the requests it had end with errors at once
    (they waited forever), /health and new requests say 503, the gauges read 0 (they kept the last counts)."""
    def abort(self, request_id):
        raise RuntimeError("injected abort fault")

    monkeypatch.setattr(llm_engine_module.LLMEngine, "abort", abort)
    with live_server(tiny_config(tiny_model_dir, max_model_len=2048)) as live:
        engine = live.state.engine
        full, lines = _with_requests_in_flight(live.url, lambda: engine.num_running,
                                               lambda: engine.release("gone", abort=True))
        assert not engine.is_alive and engine.num_in_flight == 0
        _assert_failed_cleanly(live.url, full, lines)


def test_a_dead_engine_core_fails_its_requests_and_reads_idle(tiny_model_dir):
    """The engine core SIGKILLed with requests in flight: a 500 and an error chunk, /health 503, and the gauges at 0."""
    with live_server(tiny_config(tiny_model_dir, max_model_len=2048), engine_process=True, ready_timeout=120) as live:
        core = live.state.engine
        full, lines = _with_requests_in_flight(live.url, lambda: core.num_running, core._proc.kill)
        _assert_failed_cleanly(live.url, full, lines)


def test_a_request_whose_send_fails_leaves_no_route_behind(tiny_model_dir):
    """The core's pipe broke under a request being sent (the core died; its EOF not read yet): a 503, and the outputs
    route the client registered for it is dropped (it stayed for good)."""
    client = EngineCoreClient(tiny_config(tiny_model_dir))
    client._proc, client._reading = SimpleNamespace(is_alive=lambda: True), True
    client._conn = SimpleNamespace(send=lambda message: (_ for _ in ()).throw(BrokenPipeError("broken pipe")))
    serving = SimpleNamespace(engine=client)

    async def main():
        params = SamplingParams(max_tokens=4)
        with pytest.raises(APIError) as refused:
            OpenAIServing._submit(serving, [([1, 2], params), ([3, 4], params)], 1, "cmpl-x")
        assert refused.value.status == 503

    asyncio.run(main())
    assert client._queues == {}
