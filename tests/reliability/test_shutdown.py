"""SIGTERM on a real `neuronmm serve` subprocess: 503 for new work, in-flight requests finish within the grace
period, exit 0; a request outliving the grace period is cut off; a second SIGTERM ends the process at once."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from bench.load import ServerProcess, write_config

pytestmark = pytest.mark.slow

GRACE_S = 0.3
API_KEY = "sk-reliability-" + "7f3a9c" * 4


def _spawn(path, tiny_model_dir, grace_s: float, api_key: str | None = None) -> ServerProcess:
    path.mkdir()
    server = {"shutdown_grace_s": grace_s, "log_level": "debug"}
    config = write_config(path / "serve.yaml", tiny_model_dir, server=server,
                          engine={"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 4096,
                                  "num_threads": 1})
    return ServerProcess(config, path / "server.log", api_key=api_key)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    """Three servers, started side by side (each test ends its own with signals)."""
    root = tmp_path_factory.mktemp("shutdown")
    procs = {"drain": _spawn(root / "drain", tiny_model_dir, grace_s=60, api_key=API_KEY),
             # short enough that 4,000 tokens cannot finish inside it (the tiny model once took ~1.5 s for them)
             "grace": _spawn(root / "grace", tiny_model_dir, grace_s=GRACE_S),
             "twice": _spawn(root / "twice", tiny_model_dir, grace_s=60)}
    try:
        for proc in procs.values():
            proc.wait_ready(timeout=180)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _stream(proc: ServerProcess, max_tokens: int, result: dict) -> None:
    """Stream one completion in a thread; records the events, whether [DONE] came, and the first-token time."""
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", f"{proc.url}/v1/completions", json=body, headers=proc.headers, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    result.setdefault("first_event", time.monotonic())
    except httpx.HTTPError as exc:
        result["error"] = exc.__class__.__name__
    result["events"] = events
    result["done"] = bool(events) and events[-1] == "[DONE]"


def _start_stream(proc: ServerProcess, max_tokens: int) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=_stream, args=(proc, max_tokens, result), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while "first_event" not in result and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "first_event" in result, result
    return thread, result


def test_sigterm_drains_in_flight_then_exits_0(servers):
    proc = servers["drain"]
    thread, result = _start_stream(proc, max_tokens=1000)  # a second or more of decoding on the tiny model
    sigterm_at = time.monotonic()
    proc.signal(signal.SIGTERM)
    time.sleep(0.1)
    refused = httpx.post(f"{proc.url}/v1/completions", headers=proc.headers, timeout=10,
                         json={"model": "tiny", "prompt": "late", "max_tokens": 2})
    health = httpx.get(f"{proc.url}/health", timeout=10)
    assert proc.proc.poll() is None, "exited while a request was in flight"
    rc = proc.wait(timeout=120)
    drain_s = time.monotonic() - sigterm_at
    thread.join(10)
    log = proc.log_text()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert result["status"] == 200 and result["done"], (result.get("error"), result["events"][-2:])
    chunks = [json.loads(e) for e in result["events"][:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert rc == 0, log[-2000:]
    assert drain_s < 60  # it left as soon as the stream finished, long before the grace period
    assert "drained in" in log
    assert API_KEY not in log  # debug logging of every request never printed the key
    print(f"\ndrain: {drain_s:.2f} s from SIGTERM to exit 0 with one 1,000-token stream in flight")


def test_grace_period_cuts_off_a_long_request_and_still_exits_0(servers):
    proc, grace_s = servers["grace"], GRACE_S
    thread, result = _start_stream(proc, max_tokens=4000)
    sigterm_at = time.monotonic()
    proc.signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    elapsed = time.monotonic() - sigterm_at
    thread.join(10)
    assert rc == 0
    assert grace_s <= elapsed < grace_s + 5, elapsed
    assert not result["done"]  # the stream was cut, not completed


def test_second_sigterm_exits_at_once(servers):
    proc = servers["twice"]
    _start_stream(proc, max_tokens=4000)
    proc.signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.proc.poll() is None  # draining
    second_at = time.monotonic()
    proc.signal(signal.SIGTERM)
    rc = proc.wait(timeout=10)
    elapsed = time.monotonic() - second_at
    assert rc == -signal.SIGTERM  # the default action: killed by the signal, no drain
    assert elapsed < 2, elapsed
