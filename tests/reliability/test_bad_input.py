"""Hand-written bad requests (beyond tests/server/test_api.py): each gets a 4xx OpenAI error, never a 5xx.

Unknown fields are ignored and logged, as vLLM does (tests/server/test_api_openai.py); with
server.strict_fields they are refused with 400 "unrecognized request argument", nested ones named by
their path (checked here). The server stays healthy after every case (checked at the end).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from support import live_server, tiny_config

ERROR_KEYS = {"message", "type", "param", "code"}
JSON = {"content-type": "application/json"}


BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=256)
    cfg.server.strict_fields = True
    cfg.server.body_timeout_s = BODY_TIMEOUT_S
    with live_server(cfg) as server:
        yield server


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:300]
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS and body["error"]["message"]
    return body["error"]


def _post(live, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", timeout=60, **kwargs)


CMPL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, param", [
    # wrong JSON types
    ("/v1/completions", {**CMPL, "prompt": 5}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [1.5]}, "prompt"),
    ("/v1/completions", {**CMPL, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {**CMPL, "n": "many"}, "n"),
    ("/v1/completions", {**CMPL, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**CMPL, "stream": [1]}, "stream"),
    ("/v1/completions", {**CMPL, "stop": 5}, "stop"),
    ("/v1/completions", {**CMPL, "model": 5}, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages"),
    # out-of-range numbers
    ("/v1/completions", {**CMPL, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**CMPL, "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {**CMPL, "max_tokens": 2**64}, "max_tokens"),  # huge: context length error
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {**CMPL, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**CMPL, "temperature": 2.5}, "temperature"),
    ("/v1/completions", {**CMPL, "top_p": 0}, "top_p"),
    ("/v1/completions", {**CMPL, "top_p": -0.1}, "top_p"),
    ("/v1/completions", {**CMPL, "top_p": 1.0000001}, "top_p"),
    ("/v1/completions", {**CMPL, "seed": 2**64}, "seed"),
    ("/v1/completions", {**CMPL, "presence_penalty": 3}, "presence_penalty"),
    # empty input
    ("/v1/completions", {**CMPL, "prompt": []}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [[]]}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": ["ok", ""]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    # counts over the limits
    ("/v1/completions", {**CMPL, "n": 17}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/completions", {**CMPL, "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/completions", {**CMPL, "stop": "x" * 257}, "stop"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None),  # needs logprobs: true
    ("/v1/completions", {**CMPL, "logprobs": -1}, "logprobs"),
    # prompts that cannot fit, refused before tokenizing
    ("/v1/completions", {**CMPL, "prompt": "word " * 200_000}, "prompt"),
    ("/v1/completions", {**CMPL, "prompt": [1] * 100_000}, "prompt"),
    # unknown fields, also nested: refused (server.strict_fields is on for this module)
    ("/v1/completions", {**CMPL, "functions": []}, "functions"),
    ("/v1/completions", {**CMPL, "stream": True, "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "mood": "ok"}]}, "messages.0.mood"),
])
def test_bad_request_is_a_400_naming_the_field(live, path, body, param):
    err = _error(_post(live, path, json=body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param.split(".")[0], err
        if "." in param:
            assert err["param"] == param and "unrecognized request argument" in err["message"]


@pytest.mark.parametrize("name, raw", [
    ("not json", b"{model: tiny}"),
    ("truncated", b'{"model": "tiny", "prompt": "x"'),
    ("empty body", b""),
    ("json array", b"[1, 2]"),
    ("json null", b"null"),
    ("NaN", b'{"model": "tiny", "prompt": "x", "temperature": NaN}'),
    ("Infinity", b'{"model": "tiny", "prompt": "x", "top_p": Infinity}'),
    ("invalid UTF-8", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}'),
    ("lone surrogate", b'{"model": "tiny", "prompt": "\\ud800"}'),
    ("lone surrogate in model", b'{"model": "\\udfff", "prompt": "x"}'),
    ("deep nesting", b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
])
def test_malformed_body_is_a_4xx_error(live, name, raw):
    status = 404 if name == "lone surrogate in model" else 400
    err = _error(_post(live, "/v1/completions", content=raw, headers=JSON), status)
    if name in ("not json", "truncated"):  # says what is wrong and where, and names no field
        assert err["message"].startswith("request body is not valid JSON: ") and "at character" in err["message"]
        assert err["param"] is None


def test_chat_lone_surrogate_is_a_400(live):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    assert _error(_post(live, "/v1/chat/completions", content=raw, headers=JSON), 400)["param"] == "messages"


def test_ten_megabyte_prompt_is_a_413_with_and_without_content_length(live):
    body = json.dumps({**CMPL, "prompt": "a" * 10_000_000}).encode()
    start = time.monotonic()
    assert _error(_post(live, "/v1/completions", content=body, headers=JSON), 413)["code"] == "body_too_large"

    def chunks():  # no Content-Length: the guard must count the chunked body as it arrives
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    assert _error(_post(live, "/v1/completions", content=chunks(), headers=JSON), 413)["code"] == "body_too_large"
    assert time.monotonic() - start < 10


def test_stalled_body_is_a_408_and_frees_the_connection(live):
    """A client that announces 1,000 bytes, sends 20 and stalls is answered 408 after body_timeout_s."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"model": "tiny", ')
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - start
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert BODY_TIMEOUT_S <= elapsed < BODY_TIMEOUT_S + 5


def test_slow_but_steady_body_is_served(live):
    def trickle():  # every piece arrives well within the timeout
        raw = json.dumps({**CMPL, "prompt": "slow " * 20}).encode()
        for i in range(0, len(raw), 40):
            time.sleep(BODY_TIMEOUT_S / 4)
            yield raw[i:i + 40]

    assert _post(live, "/v1/completions", content=trickle(), headers=JSON).status_code == 200


def test_streaming_response_is_not_cut_by_the_body_timeout(live):
    body = {**CMPL, "max_tokens": 200, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as resp:
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                time.sleep(BODY_TIMEOUT_S * 1.5 / 200)  # a slow reader: the response outlives the timeout
    assert events[-1] == "data: [DONE]" and len(events) == 201
    assert time.monotonic() - start > BODY_TIMEOUT_S


def test_wrong_method_and_unknown_path_get_the_envelope(live):
    _error(httpx.get(f"{live.url}/v1/completions"), 405)
    _error(httpx.get(f"{live.url}/v1/nothing-here"), 404)


@pytest.mark.parametrize("body", [
    {**CMPL, "prompt": "\x00\x01", "stop": ""},  # control characters, an empty stop string
    # 256 sequences from one request, queued behind 4 slots: the 16-request queue limit counts
    # requests, not choices (n=16 used to fill it with one prompt and 429 the rest)
    {**CMPL, "prompt": ["a"] * 16, "n": 16},
    {**CHAT, "messages": [{"role": "assistant", "content": ""}]},
    {**CHAT, "messages": [{"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}"}]},  # not a template
    {**CMPL, "temperature": 1e-300, "top_p": 1e-300, "presence_penalty": 2, "frequency_penalty": -2},
])
def test_odd_but_valid_requests_are_served(live, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = _post(live, path, json=body)
    assert resp.status_code == 200, resp.text[:300]
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    assert len(resp.json()["choices"]) == n


def test_server_still_healthy_after_bad_input(live):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    resp = _post(live, "/v1/completions", json={**CMPL, "max_tokens": 5, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
    assert live.state.runtime.engine.scheduler.kv.num_free == live.state.runtime.engine.scheduler.kv.capacity
