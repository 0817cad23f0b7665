"""The OpenAI-compatible API against a real uvicorn server on 127.0.0.1 (tiny random model)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from server.backends.base import SeqChunk
from support import live_server, tiny_config


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir, max_model_len=1024)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics, by sample name and a subset of its labels (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_with_usage(client):
    resp = client.completions.create(model="tiny", prompt="Hello there", max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7 and resp.usage.prompt_tokens > 0


def test_chat_uses_template(client, server):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0)
    tok = server.state.runtime.tokenizer
    expected = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                      add_generation_prompt=True)))
    assert resp.usage.prompt_tokens == expected
    assert resp.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_text_equals_non_streamed_at_temperature_0(client, kind):
    args = dict(model="tiny", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    if kind == "completion":
        full = client.completions.create(prompt="Once upon a time", **args).choices[0].text
        stream = client.completions.create(prompt="Once upon a time", stream=True,
                                           stream_options={"include_usage": True}, **args)
        chunks = list(stream)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        msgs = [{"role": "user", "content": "Tell me a story"}]
        full = client.chat.completions.create(messages=msgs, **args).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=msgs, stream=True,
                                                     stream_options={"include_usage": True}, **args))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full and len(full) > 0
    assert chunks[-1].usage.completion_tokens == 24


def test_seeded_sampling_is_reproducible(client):
    args = dict(model="tiny", prompt="The sea", max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **args).choices[0].text
    b = client.completions.create(seed=7, **args).choices[0].text
    c = client.completions.create(seed=8, **args).choices[0].text
    assert a == b and a != c


def test_n_choices_and_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="abc", max_tokens=4, n=3, temperature=1.0, seed=3,
                                     logprobs=5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(top) <= 5 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e.logprob >= max(t.logprob for t in e.top_logprobs) - 1e-5 for e in content)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": [999999999]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    resp = httpx.post(f"{server.url}/v1/completions", json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_context_length_error_names_both_numbers(server):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3000})
    assert resp.status_code == 400
    msg = resp.json()["error"]["message"]
    assert "3000" in msg and "1024" in msg


def test_chat_errors(server):
    url = f"{server.url}/v1/chat/completions"
    assert httpx.post(url, json={"model": "tiny", "messages": []}).status_code == 400
    assert httpx.post(url, json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}).status_code == 400
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400


def test_content_parts_other_than_text_are_named_in_the_error(server):
    url = f"{server.url}/v1/chat/completions"
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    resp = httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    error = resp.json()["error"]
    assert resp.status_code == 400 and "content part type 'image_url' is not supported" in error["message"]
    assert error["param"].startswith("messages.0")
    ok = httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": parts[:1]}], "max_tokens": 2})
    assert ok.status_code == 200


def test_concurrent_requests_share_a_forward(server, client):
    before = server.state.runtime.engine.max_batch_size_seen

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as ac:
            await asyncio.gather(*(ac.completions.create(model="tiny", prompt=f"p{i}", max_tokens=40,
                                                         temperature=0, extra_body={"ignore_eos": True})
                                   for i in range(4)))

    asyncio.run(run())
    assert server.state.runtime.engine.max_batch_size_seen >= 2 or before >= 2
    le1 = metric(server.url, "neuronmm_batch_size_bucket", le="1.0")
    total = metric(server.url, "neuronmm_batch_size_count")
    assert total > le1  # some forwards carried more than one sequence


def _wait_idle(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(url, "neuronmm_num_requests_running") == 0 and metric(url, "neuronmm_num_requests_waiting") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("engine did not go idle")


def test_streaming_disconnect_frees_slot(server):
    slots = server.state.runtime.engine.scheduler.kv
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={"model": "tiny", "prompt": "go", "max_tokens": 200, "stream": True,
                            "ignore_eos": True, "temperature": 0}) as resp:
        lines = resp.iter_lines()
        assert next(l for l in lines if l.startswith("data:"))
        assert metric(server.url, "neuronmm_num_requests_running") == 1
    _wait_idle(server.url)
    assert slots.num_free == slots.capacity


def test_non_streaming_disconnect_aborts(server):
    slots = server.state.runtime.engine.scheduler.kv
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json={"model": "tiny", "prompt": "go", "max_tokens": 1000, "ignore_eos": True})
    _wait_idle(server.url)
    assert slots.num_free == slots.capacity
    assert metric(server.url, "neuronmm_request_success_total", finished_reason="abort") >= 1


def test_queue_full_gets_429_with_retry_after(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_num_seqs=1, max_queue=1, max_model_len=2048)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with live_server(cfg) as live:
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as first:
            first_lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(l for l in first_lines if l.startswith("data:"))
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as second:
                assert second.status_code == 200
                deadline = time.monotonic() + 5
                while metric(live.url, "neuronmm_num_requests_waiting") < 1 and time.monotonic() < deadline:
                    time.sleep(0.02)
                third = httpx.post(f"{live.url}/v1/completions", json=body)
                assert third.status_code == 429
                assert third.headers["retry-after"] and third.json()["error"]["type"] == "rate_limit_error"


def test_api_key_required_when_configured(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.api_key = "s3cret"
    with live_server(cfg) as live:
        assert httpx.get(f"{live.url}/health").status_code == 200
        assert httpx.get(f"{live.url}/ping").status_code == 200  # SageMaker's health check needs no key
        assert httpx.get(f"{live.url}/v1/models").status_code == 401
        assert httpx.post(f"{live.url}/invocations", json={"prompt": "x", "max_tokens": 1}).status_code == 401
        for path in ("/completion", "/infill", "/score", "/rerank", "/v2/rerank", "/apply-template", "/tokenize"):
            assert httpx.post(f"{live.url}{path}", json={}).status_code == 401, path  # routes off /v1 too
        assert httpx.get(f"{live.url}/props").status_code == 401
        bad = httpx.get(f"{live.url}/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=f"{live.url}/v1", api_key="s3cret").models.list()
        assert ok.data[0].id == "tiny"


class _PoisonRunner:
    """Wraps a runner; a sequence whose prompt starts with token 7 fails once it reaches position 5."""

    def __init__(self, inner):
        self.inner = inner
        self.poisoned: set[int] = set()

    def execute(self, chunks: list[SeqChunk]):
        for c in chunks:
            if c.start_pos == 0:
                self.poisoned.discard(c.slot)
                if c.token_ids[0] == 7:
                    self.poisoned.add(c.slot)
            elif c.slot in self.poisoned and c.start_pos >= 5:
                self.poisoned.discard(c.slot)
                raise RuntimeError("injected fault")
        return self.inner.execute(chunks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_engine_fault_fails_request_and_server_keeps_serving(tiny_model_dir):
    from server.runtime import load_runtime

    def loader(cfg):
        rt = load_runtime(cfg)
        rt.engine.runner = _PoisonRunner(rt.engine.runner)
        return rt

    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 20, "ignore_eos": True}
    with live_server(tiny_config(tiny_model_dir), loader) as live:
        resp = httpx.post(f"{live.url}/v1/completions", json=body)
        assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as stream:
            events = [l[6:] for l in stream.iter_lines() if l.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert json.loads(events[0])["choices"][0]["text"] is not None  # tokens came before the error
        ok = httpx.post(f"{live.url}/v1/completions", json={**body, "prompt": [8, 9]})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20


def test_after_a_failed_load_requests_say_so_without_a_retry_hint(tiny_model_dir):
    from fastapi.testclient import TestClient

    from server.api.app import create_app

    def broken(_cfg):
        raise RuntimeError("weights unreadable")

    app = create_app(tiny_config(tiny_model_dir), broken)
    with TestClient(app) as client:
        state, deadline = app.state.neuronmm, time.monotonic() + 30
        while state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "weights unreadable" in client.get("/health").json()["status"]
        for path in ("/v1/completions", "/tokenize"):  # the guard's 503, and a route's own
            resp = client.post(path, json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            error = resp.json()["error"]
            assert resp.status_code == 503 and error["code"] == "load_failed" and "Retry-After" not in resp.headers
            assert error["message"] == "model failed to load: RuntimeError: weights unreadable"


def test_stream_events_stay_one_line_for_splitlines_clients():
    """Sampled text can hold U+2028, U+2029 or U+0085: JSON leaves them raw, and str.splitlines (so httpx's
    aiter_lines) ends a line there. The event escapes them: one line, decoding to the same text."""
    from server.api.protocol import CompletionChoice, StreamChunk

    text = "a\u2028b\u2029c\x85d é"
    chunk = StreamChunk(id="x", object="text_completion", created=0, model="m",
                        choices=[CompletionChoice(index=0, text=text)])
    lines = [line for line in chunk.sse(include_usage=False).splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    assert "é" in lines[0]  # other non-ASCII stays raw UTF-8


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_is_read_whatever_its_content_type(server, content_type):
    """curl -d sends a form type: the body is still the request, as llama.cpp's server reads it."""
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}'
    resp = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    broken = httpx.post(f"{server.url}/v1/completions", content=b"prompt=Hi", headers=headers)
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]



def test_load_reports_the_requests_in_flight(server):
    """GET /load is the count the graceful drain waits on (requests that may run the model), open without a key."""
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    server.state.num_active += 2  # as two generation requests inside the app hold it
    try:
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 2}
    finally:
        server.state.num_active -= 2
