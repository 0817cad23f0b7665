"""Many requests at once: concurrent streams with n > 1, include_usage and logprobs each get what their full reply
says, the server goes back to idle after; a batch the queue can never hold is refused for good (400), not asked to
retry (429); a stream whose chunk cannot be made ends with an error chunk, not a cut connection."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.api.serving import OpenAIServing
from support import live_server, tiny_config, wait_for

MAX_QUEUE = 24


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir, max_model_len=512, max_num_seqs=8, max_queue=MAX_QUEUE)) as server:
        yield server


def _body(i: int) -> tuple[str, dict]:
    """Request i: chat or completions, 3 seeded sampled choices with logprobs."""
    common = {"model": "tiny", "n": 3, "seed": i, "temperature": 0.9, "max_tokens": 12 + i}
    if i % 2:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"hi {i}"}],
                                        "logprobs": True, "top_logprobs": 2}
    return "/v1/completions", {**common, "prompt": f"story {i}", "logprobs": 2}


def _choice_of(chunk_choice: dict) -> tuple[str, list[str]]:
    """A choice's (text, tokens), from a full reply's choice or a stream chunk's."""
    if "message" in chunk_choice or "delta" in chunk_choice:
        part = chunk_choice.get("message") or chunk_choice["delta"]
        logprobs = chunk_choice.get("logprobs") or {"content": []}
        return part.get("content") or "", [t["token"] for t in logprobs["content"]]
    return chunk_choice["text"], (chunk_choice.get("logprobs") or {"tokens": []})["tokens"]


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, list[dict]]:
    """Each choice's text, tokens and finish reason from a stream, and its usage chunks."""
    choices, usages = {}, []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                assert chunk["choices"] == []
                usages.append(chunk["usage"])
            for c in chunk["choices"]:
                text, tokens = _choice_of(c)
                got = choices.setdefault(c["index"], {"text": "", "tokens": [], "finish": None})
                got["text"] += text
                got["tokens"] += tokens
                got["finish"] = c["finish_reason"] or got["finish"]
    return choices, usages


def test_concurrent_streams_match_their_full_replies(live):
    bodies = [_body(i) for i in range(10)]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            full = await asyncio.gather(*(client.post(live.url + path, json=body) for path, body in bodies))
            streamed = await asyncio.gather(*(_streamed(client, live.url + path, body) for path, body in bodies))
        return [r.json() for r in full], streamed

    full, streamed = asyncio.run(main())
    for reply, (choices, usages) in zip(full, streamed):
        assert len(usages) == 1 and len(choices) == 3
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # (cached tokens differ: a prompt repeats)
            assert usages[0][key] == reply["usage"][key]
        for c in reply["choices"]:
            text, tokens = _choice_of(c)
            assert choices[c["index"]] == {"text": text, "tokens": tokens, "finish": c["finish_reason"]}
    wait_for(lambda: live.state.engine.num_in_flight == 0 and not live.state.runtime.engine.seqs, 5)
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'neuronmm_num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'neuronmm_num_requests_waiting{model_name="tiny"} 0.0' in metrics


def test_a_batch_larger_than_the_queue_is_refused_not_retried(live):
    """Each prompt of a batch waits in the engine: a batch over max_queue never fits, even on an idle server (its 429
    asked the client to retry it forever); one that fits is served."""
    prompts = [[100 + i, 200 + i] for i in range(MAX_QUEUE + 1)]
    resp = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1})
    assert resp.status_code == 400 and "engine.max_queue" in resp.json()["error"]["message"]
    assert "retry-after" not in resp.headers
    resp = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": prompts[1:], "max_tokens": 1})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == MAX_QUEUE


def test_a_stream_whose_chunk_cannot_be_made_ends_with_an_error_chunk(live, monkeypatch):
    """A bug while making a chunk (here: its choice) ends that stream with an error chunk and [DONE] (the connection
    was cut mid-body: clients saw a protocol error), its engine request aborted; the server serves on."""
    def broken(self, out, index, state):
        raise KeyError("injected chunk fault")

    monkeypatch.setattr(OpenAIServing, "_completion_delta", broken)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert json.loads(lines[0][6:])["error"]["type"] == "server_error" and lines[1:] == ["data: [DONE]"]
    wait_for(lambda: live.state.engine.num_in_flight == 0 and not live.state.runtime.engine.seqs, 5)
    monkeypatch.undo()
    resp = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200


@pytest.mark.parametrize("path, body, ends", [
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400},
     lambda lines: lines[-2] == "event: error" and json.loads(lines[-1][6:])["error"]["type"] == "api_error"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 400},
     lambda lines: lines[-2] == "event: response.failed"
     and json.loads(lines[-1][6:])["response"]["error"]["message"] == "internal error: KeyError"),
])
def test_the_other_stream_formats_end_a_chunk_fault_with_their_error_event(live, monkeypatch, path, body, ends):
    """The Messages and Responses streams are built on the chat chunks: a fault in making one reaches them as the
    engine errors do, so each ends with its own error event; the request is aborted."""
    def broken(self, out, index, state):
        raise KeyError("injected chunk fault")

    monkeypatch.setattr(OpenAIServing, "_chat_delta", broken)
    with httpx.stream("POST", f"{live.url}{path}", json={"model": "tiny", "stream": True, **body}, timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert ends(lines), lines[-3:]
    wait_for(lambda: live.state.engine.num_in_flight == 0 and not live.state.runtime.engine.seqs, 5)
