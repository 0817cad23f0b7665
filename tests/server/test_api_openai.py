"""What vLLM users and agent frameworks send: the three fixed wrong results, extra fields and sampling
fields, tokenizer/version/model endpoints, request ids, vLLM metric names, tools and structured output."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from server.api.generation_defaults import check_sampling_defaults, sampling_defaults
from server.config import ConfigError
from server.engine.structured import token_bytes
from support import live_server, tiny_config
from test_api import metric


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=1024)
    cfg.server.model_aliases = ["tiny-alias"]
    with live_server(cfg) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.state.serving.tokenizer


def _sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- the three wrong results ------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_prompt_tokens_are_not_multiplied_by_n(server, tokenizer, stream):
    ids = tokenizer.encode("one two three")
    body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "n": 2, "temperature": 1.0, "ignore_eos": True}
    if stream:
        events = _sse(f"{server.url}/v1/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        usage = events[-1]["usage"]
    else:
        usage = httpx.post(f"{server.url}/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == len(ids) + 4


def test_streamed_text_offset_continues_across_chunks(server):
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    full = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    events = _sse(f"{server.url}/v1/completions", {**body, "stream": True})
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == full["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] > 0


def test_chat_logprobs_of_a_split_character_carry_its_bytes(client, tokenizer):
    first = tokenizer.encode("🙂", add_special_tokens=False)[0]
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "smile"}],
                                          max_tokens=1, temperature=0, logprobs=True, top_logprobs=20,
                                          logit_bias={str(first): 100})
    entry = resp.choices[0].logprobs.content[0]
    expected = token_bytes(tokenizer, first)
    assert entry.bytes == list(expected) and expected != "🙂".encode()  # a part of the character
    assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in expected)
    assert len(entry.top_logprobs) == 20


# ---- fields real clients send -----------------------------------------------------------------
def test_unknown_and_compat_fields_are_accepted(client, server):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="u1", store=False,
        metadata={"k": "v"}, parallel_tool_calls=False, response_format={"type": "text"},
        extra_body={"bogus_field": 1, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 1,
                    "skip_special_tokens": True})
    assert resp.choices[0].message.role == "assistant"
    server.state.serving.strict_fields = True
    try:
        strict = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "bogus": 1})
        assert strict.status_code == 400 and strict.json()["error"]["param"] == "bogus"
    finally:
        server.state.serving.strict_fields = False


def test_logit_bias_and_stop_token_ids_steer_generation(server, tokenizer):
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(forced): 100}}
    resp = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert resp["choices"][0]["text"] == tokenizer.decode([forced] * 5)
    stopped = httpx.post(f"{server.url}/v1/completions", json={**body, "stop_token_ids": [forced]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    assert stopped["choices"][0]["stop_reason"] == forced  # vLLM's: what stopped it
    assert resp["choices"][0]["stop_reason"] is None  # (it ran to max_tokens)


def test_stop_reason_names_the_stop_string_or_token(server, tokenizer):
    """vLLM's stop_reason: the stop string matched, the stop token id, or null for EOS; streamed, on the last chunk."""
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(forced): 100}, "stop": ["nope", "nana ba"]}
    done = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    assert done["finish_reason"] == "stop" and done["stop_reason"] == "nana ba" and done["text"] == " ba"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        **{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": "x"}]}).json()
    assert chat["choices"][0]["stop_reason"] == "nana ba"
    for route, extra in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):
        fields = {k: v for k, v in body.items() if k != "prompt"}
        events = _sse(f"{server.url}/v1/{route}", {**fields, **extra, "stream": True})
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert choices[-1]["stop_reason"] == "nana ba" and all("stop_reason" not in c for c in choices[:-1])
    eos = tokenizer.eos_token_id
    at_eos = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                              "logit_bias": {str(eos): 100}}).json()["choices"][0]
    assert at_eos["finish_reason"] == "stop" and at_eos["stop_reason"] is None


def test_return_token_ids_give_the_prompt_and_reply_tokens(server, tokenizer):
    """vLLM's return_token_ids (what RL trainers read instead of re-tokenising): the prompt's ids (a chat's template
    rendering) and each choice's generated ids, whole or a chunk's new ones (the prompt's on the first chunk only);
    return_tokens_as_token_ids names logprob tokens by id. Without them, neither appears."""
    fields = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1,
              "return_token_ids": True, "return_tokens_as_token_ids": True}
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "one two three"}).json()["tokens"]
    done = httpx.post(f"{server.url}/v1/completions", json={**fields, "prompt": "one two three"}).json()["choices"][0]
    assert done["prompt_token_ids"] == prompt_ids and len(done["token_ids"]) == 6
    assert tokenizer.decode(done["token_ids"]) == done["text"]
    assert done["logprobs"]["tokens"] == [f"token_id:{t}" for t in done["token_ids"]]
    assert all(key.startswith("token_id:") for top in done["logprobs"]["top_logprobs"] for key in top)
    events = _sse(f"{server.url}/v1/completions", {**fields, "prompt": "one two three", "stream": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == done["token_ids"]

    messages = [{"role": "user", "content": "one two three"}]
    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    chat_fields = {**fields, "messages": messages, "logprobs": True, "top_logprobs": 1}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=chat_fields).json()
    reply = chat["choices"][0]
    assert chat["prompt_token_ids"] == chat_ids and tokenizer.decode(reply["token_ids"]) == reply["message"]["content"]
    assert [c["token"] for c in reply["logprobs"]["content"]] == [f"token_id:{t}" for t in reply["token_ids"]]
    events = _sse(f"{server.url}/v1/chat/completions", {**chat_fields, "stream": True})
    assert events[0]["prompt_token_ids"] == chat_ids and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == reply["token_ids"]

    plain = {k: v for k, v in fields.items() if not k.startswith("return_")}
    done = httpx.post(f"{server.url}/v1/completions", json={**plain, "prompt": "one two three"}).json()["choices"][0]
    assert done.get("token_ids") is None and done.get("prompt_token_ids") is None
    assert not any(t.startswith("token_id:") for t in done["logprobs"]["tokens"])
    events = _sse(f"{server.url}/v1/chat/completions", {**plain, "logprobs": True, "messages": messages,
                                                         "stream": True})
    assert not any("prompt_token_ids" in e or "token_ids" in e["choices"][0] for e in events)


def test_a_body_request_id_names_the_reply(server):
    """vLLM's request_id field: the reply's id after cmpl- / chatcmpl- (as X-Request-Id sets it); a malformed one is
    a 400."""
    done = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "job-7.a"})
    assert done.json()["id"] == "cmpl-job-7.a"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "request_id": "job-8"}).json()
    assert chat["id"] == "chatcmpl-job-8"
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_min_tokens_holds_off_eos(server, tokenizer):
    eos = tokenizer.eos_token_id
    body = {"model": "tiny", "prompt": "x", "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    early = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert early["usage"]["completion_tokens"] == 1  # EOS at once
    held = httpx.post(f"{server.url}/v1/completions", json={**body, "min_tokens": 4}).json()
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"


def test_echo_prepends_the_prompt(client):
    resp = client.completions.create(model="tiny", prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert resp.choices[0].text.startswith("Echo me") and len(resp.choices[0].text) > len("Echo me")


def test_continue_final_message_goes_on_from_the_assistants_text(server, tokenizer):
    """vLLM's continue_final_message: the prompt ends with the last assistant message's text (no end of turn, no new
    turn), and the reply continues it, as a plain completion of that prompt does."""
    messages = [{"role": "user", "content": "Count with me"}, {"role": "assistant", "content": "One, two,"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages, **fields}).json()["tokens"]
    assert tokenizer.decode(ids).endswith("One, two,")
    closed = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages,
                                                        "add_generation_prompt": False}).json()["tokens"]
    assert closed[:len(ids)] == ids and len(closed) > len(ids)  # without it the template closes the turn
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": messages, **fields}).json()
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ids}).json()
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("fields, messages", [
    ({"continue_final_message": True}, [{"role": "assistant", "content": "a"}]),  # add_generation_prompt defaults on
    ({"continue_final_message": True, "add_generation_prompt": False}, [{"role": "user", "content": "a"}]),
])
def test_continue_final_message_needs_an_assistant_message_and_no_generation_prompt(server, fields, messages):
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = httpx.post(f"{server.url}{path}", json={"model": "tiny", "messages": messages, **fields})
        assert resp.status_code == 400 and "continue_final_message" in resp.json()["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),  # past the vocabulary: refused, not ignored
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 4, "min_tokens": 5}, None),
    ({"stream_options": {"include_usage": True}}, None),  # without stream: true (OpenAI and vLLM refuse it too)
])
def test_bad_sampling_fields_get_400(server, body, param):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


# ---- endpoints, request ids, metrics ----------------------------------------------------------
def test_tokenize_detokenize_version_models(server, tokenizer):
    tok = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": "Hello world"}).json()
    assert tok["tokens"] == tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    assert httpx.get(f"{server.url}/v1/models/nope").status_code == 404
    head = httpx.head(f"{server.url}/health")
    assert head.status_code == 200 and head.content == b""


def test_model_aliases_serve_and_unknown_names_404(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    assert client.completions.create(model="tiny-alias", prompt="x", max_tokens=1).model == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny-other", prompt="x", max_tokens=1)


def test_x_request_id_is_used_and_echoed(server):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                      headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123" and resp.json()["id"] == "cmpl-abc-123"
    again = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                       headers={"X-Request-Id": "abc-123"})
    assert again.status_code == 200  # a repeated id is not an engine conflict
    generated = httpx.get(f"{server.url}/health").headers["x-request-id"]
    assert len(generated) == 32 and httpx.get(f"{server.url}/health").headers["x-request-id"] != generated


def test_vllm_metric_names_http_status_and_process_metrics(server, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=2)
    httpx.get(f"{server.url}/v1/models/nope")
    assert metric(server.url, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(server.url, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(server.url, "vllm:request_queue_time_seconds_count") >= 1
    assert metric(server.url, "vllm:request_prompt_tokens_count") >= 1
    assert metric(server.url, "vllm:num_requests_running") == metric(server.url, "neuronmm_num_requests_running")
    assert metric(server.url, "http_requests_total", handler="/v1/completions", status="2xx") >= 1
    assert metric(server.url, "http_requests_total", handler="/v1/models/{model_id:path}", status="4xx") >= 1
    assert metric(server.url, "process_resident_memory_bytes") > 0


# ---- structured output ------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [1, 2])
def test_response_format_json_schema_parses_with_the_schema(client, seed):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Plan a trip"}], max_tokens=60, temperature=1.0,
        seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # the grammar ended the sequence, not max_tokens
    value = json.loads(choice.message.content)
    assert value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 9 and set(value) == {"city", "days"}


def test_bad_schema_and_unknown_named_tool_are_400(server):
    url = f"{server.url}/v1/chat/completions"
    base = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    bad_schema = httpx.post(url, json={**base, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad_schema.status_code == 400 and bad_schema.json()["error"]["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    unknown = httpx.post(url, json={**base, "tools": [tool],
                                    "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert unknown.status_code == 400
    no_template = httpx.post(url, json={**base, "tools": [tool]})  # SmolLM2's own template has no tools
    assert no_template.status_code == 400 and no_template.json()["error"]["code"] == "tools_not_supported"


def test_a_grammar_the_engine_gives_up_on_is_a_400_not_a_stop(server):
    """A schema that refers to itself with nothing to end it (every object must hold another) runs llguidance's parser
    past its limits a few tokens in. Its forced EOS then read as a normal stop with a reply of `{"`; the request
    now fails with the grammar engine's reason, streamed or not, and the server serves on."""
    url = f"{server.url}/v1/chat/completions"
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": endless}}}
    resp = httpx.post(url, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "grammar_error" and error["type"] == "invalid_request_error"
    assert "grammar engine gave up" in error["message"]
    events = _sse(url, {**body, "stream": True})
    assert events[-1]["error"]["code"] == "grammar_error"
    assert httpx.post(url, json={**body, "response_format": None}).status_code == 200


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _sse(f"{server.url}/v1/completions", body)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == [1, 2, 3, 4] and all(e["usage"]["prompt_tokens"] == events[0]["usage"]["prompt_tokens"]
                                          for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    plain = _sse(f"{server.url}/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 4


# ---- SageMaker's routes, and requests without a model ---------------------------------------------
def test_invocations_route_chat_and_completion_bodies_and_ping_answers_health(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0.0}
    via = httpx.post(f"{server.url}/invocations", json=chat).json()
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()  # no model: the served one
    assert via["object"] == "chat.completion" and via["model"] == "tiny"
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    completion = httpx.post(f"{server.url}/invocations", json={"prompt": "Hi", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    events = _sse(f"{server.url}/invocations", {"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"
    for body, says in ((b"{", "not valid JSON"), (b"[1]", "dictionary"), (b'{"prompt": "x", "max_tokens": "2"}',
                                                                          "max_tokens")):
        bad = httpx.post(f"{server.url}/invocations", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and says in bad.json()["error"]["message"], bad.text
    assert httpx.post(f"{server.url}/invocations", json={**chat, "model": "nope"}).status_code == 404
    for method in (httpx.get, httpx.post):
        assert method(f"{server.url}/ping").json() == {"status": "ok"}


# ---- the model's sampling defaults (vLLM's --generation-config) -----------------------------------
def test_generation_config_defaults_fill_only_the_fields_a_request_leaves_unset(tiny_model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": False, "eos_token_id": 2}))
    assert sampling_defaults(tiny_model_dir, "auto") == {}  # the tiny model's own file has no sampling keys
    assert sampling_defaults(tiny_model_dir, str(tmp_path)) == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    assert sampling_defaults(tmp_path, "vllm") == {}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        sampling_defaults(tiny_model_dir, str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="top_p: Input should be less than or equal to 1"):
        check_sampling_defaults({"top_p": 5.0})
    cfg = tiny_config(tiny_model_dir, max_model_len=256)
    cfg.model.generation_config = str(tmp_path)
    with live_server(cfg) as live:
        url = f"{live.url}/v1/completions"
        plain = [httpx.post(url, json={"prompt": "Hello", "seed": s}).json() for s in (1, 2)]
        assert [p["usage"]["completion_tokens"] for p in plain] == [3, 3]  # max_new_tokens, not the API's 16
        assert plain[0]["choices"][0]["text"] == plain[1]["choices"][0]["text"]  # temperature 0: greedy
        own = httpx.post(url, json={"prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 1}).json()
        assert own["usage"]["completion_tokens"] == 6  # what a request sets wins
        chat = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_completion_tokens": 4}).json()
        assert chat["usage"]["completion_tokens"] <= 4


# ---- vLLM's prompt-side and vocabulary fields ---------------------------------------------------
def test_prompt_logprobs_rank_each_prompt_token_as_vllm_reports_them(server, tokenizer):
    prompt = "The capital of France is"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 1,
            "prompt_logprobs": 2, "echo": True, "logprobs": 0}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    ids = tokenizer(prompt).input_ids
    first, second = (c["prompt_logprobs"] for c in resp["choices"])
    assert first == second and len(first) == len(ids) and first[0] is None  # one prompt, shared by its choices
    echoed = resp["choices"][0]["logprobs"]
    for i, entry in enumerate(first[1:], 1):
        own = entry[str(ids[i])]  # the prompt token itself, first, with its rank in the vocabulary
        assert list(entry)[0] == str(ids[i]) and own["logprob"] == pytest.approx(echoed["token_logprobs"][i])
        tops = sorted((e["rank"], e["logprob"]) for t, e in entry.items() if t != str(ids[i]) or e["rank"] <= 2)
        assert [r for r, _ in tops] == [1, 2] and tops[0][1] >= tops[1][1] >= own["logprob"] - 1e-6
        assert own["rank"] >= 1 and (own["rank"] > 2) == (len(entry) == 3)
        assert len(echoed["top_logprobs"][i]) == 1  # logprobs 0: the echo keeps its own count
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0 alternatives: the token alone
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_tail(server):
    ids = list(range(100, 120))
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0.0}
    cut = httpx.post(f"{server.url}/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": 5}).json()
    tail = httpx.post(f"{server.url}/v1/completions", json={**base, "prompt": ids[-5:]}).json()
    assert cut["usage"]["prompt_tokens"] == 5 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        **base, "messages": [{"role": "user", "content": "Hi there"}], "truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3


def test_allowed_token_ids_and_bad_words_steer_the_vocabulary(server, tokenizer):
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    only = httpx.post(f"{server.url}/v1/completions", json={**body, "allowed_token_ids": [a, b]}).json()
    assert re.fullmatch("[ab]{8}", only["choices"][0]["text"])
    greedy = {**body, "temperature": 0.0, "max_tokens": 4, "logprobs": 0}
    word = httpx.post(f"{server.url}/v1/completions", json=greedy).json()["choices"][0]["logprobs"]["tokens"][0]
    assert word.strip(), "the test needs a first token with letters in it"
    banned = httpx.post(f"{server.url}/v1/completions", json={**greedy, "bad_words": [word.strip()]}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != word


def test_chat_template_kwargs_reach_the_template(server, monkeypatch):
    serving = server.state.serving
    monkeypatch.setattr(serving, "chat_template", "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "chat_template_kwargs": {"greeting": "Yo"}}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    assert serving.tokenizer.decode(tokens) == "Yo:Hi"
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    clash = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"tokenize": True}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"


def test_documents_and_reasoning_effort_reach_the_template(server, monkeypatch):
    """vLLM's documents (a RAG template's) and OpenAI's reasoning_effort (gpt-oss's template variable; a
    chat_template_kwargs value of the same name wins) render into the prompt."""
    serving = server.state.serving
    monkeypatch.setattr(serving, "chat_template", "{{ reasoning_effort }}|{% if documents %}{% for d in documents %}"
                        "[{{ d.title }}:{{ d.text }}]{% endfor %}{% endif %}|{% for m in messages %}{{ m.content }}"
                        "{% endfor %}")

    def prompt(**fields) -> str:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                "return_token_ids": True, **fields}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return serving.tokenizer.decode(reply.json()["prompt_token_ids"])

    assert prompt(documents=[{"title": "A", "text": "x"}, {"title": "B", "text": "y"}],
                  reasoning_effort="low") == "low|[A:x][B:y]|Hi"
    assert prompt() == "||Hi"
    assert prompt(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "mine"}) == "mine||Hi"
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "tiny", "reasoning_effort": "huge",
                                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and "reasoning_effort" in bad.text


@pytest.mark.parametrize("fields", [{"allowed_token_ids": []}, {"allowed_token_ids": [-1]},
                                    {"allowed_token_ids": [10 ** 6]}, {"truncate_prompt_tokens": 0},
                                    {"truncate_prompt_tokens": -2}, {"prompt_logprobs": 21}, {"bad_words": "x"}])
def test_bad_vocabulary_and_prompt_fields_are_400(server, fields):
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x", **fields})
    assert resp.status_code == 400, resp.text


# vLLM's structured_outputs, its older guided_* spelling, and response_format on completions
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("fields, pattern", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
    ({"guided_choice": ["yes", "no"]}, r"yes|no"),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, r"[0-9]{3}-[a-z]{2}"),
    ({"structured_outputs": {"grammar": 'root ::= ("on" | "off") " " [0-9]'}}, r"(on|off) [0-9]"),
    ({"guided_grammar": 'start: ("on" | "off") " " /[0-9]/'}, r"(on|off) [0-9]"),
])
def test_structured_outputs_constrain_both_endpoints(server, endpoint, fields, pattern):
    body = {"model": "tiny", "max_tokens": 40, "temperature": 1.0, "seed": 5, "n": 2, **fields}
    body |= {"messages": [{"role": "user", "content": "x"}]} if endpoint.startswith("chat") else {"prompt": "x"}
    resp = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("fields", [{"structured_outputs": {"json": SCHEMA}}, {"guided_json": SCHEMA},
                                    {"guided_json": json.dumps(SCHEMA)},
                                    {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "trip", "schema": SCHEMA}}}])
def test_json_constraints_on_completions(server, fields):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": 2, **fields}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    value = json.loads(resp.json()["choices"][0]["text"])
    assert value["city"] in ("Paris", "Rome") and set(value) == {"city", "days"}


@pytest.mark.parametrize("fields, says", [
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "got regex, choice"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "b"}, "not both"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structures"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structural_tag: not JSON"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                          "structures": [{"begin": "<g=x>", "schema": {}}]}}, "starts with none of the triggers"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="]}}, "structures"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f>", "<|im_start|>"],
                          "structures": [{"begin": "<f>x", "schema": {}}]}}, "must all be special tokens"),
    ({"structured_outputs": {"regex": "[a-"}}, "cannot compile the regex"),
    ({"guided_grammar": "root ::= ("}, "cannot compile the grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "cannot compile the schema"),
])
def test_bad_structured_outputs_are_400(server, fields, says):
    for endpoint, prompt in (("completions", {"prompt": "x"}),
                             ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": "tiny", **prompt, **fields}, timeout=60)
        assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
        assert not resp.json()["error"]["message"].startswith("Value error")


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": SCHEMA, "end": "</function>"}]}},
    {"structured_outputs": {"structural_tag": json.dumps({"triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": SCHEMA, "end": "</function>"}]})}},
])
def test_a_structural_tag_is_served_on_both_endpoints(server, fields):
    """vLLM's structural_tag (as response_format, and as structured_outputs' JSON text): text stays free until a
    trigger (tests/server/test_structural_tag.py holds a reply to the schema past one)."""
    for endpoint, prompt in (("completions", {"prompt": "x"}),
                             ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": "tiny", "max_tokens": 8, **prompt, **fields},
                          timeout=60)
        assert resp.status_code == 200, resp.text


def test_structured_outputs_and_a_forced_tool_call_are_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": "required",
        "guided_choice": ["a"]})
    assert resp.status_code == 400 and "structured_outputs cannot be combined" in resp.json()["error"]["message"]


# ---- tool calling -----------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_client(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=1024)
    cfg.server.chat_template = "hermes_tools"
    with live_server(cfg) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_required_tool_choice_returns_valid_calls(tools_client):
    resp = tools_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=3)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")
    else:
        assert call.function.name == "get_time" and args == {"tz": args["tz"]} and args["tz"] in ("UTC", "CET")
    assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_round_trip_and_streamed_deltas_reassemble(tools_client):
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    args = dict(model="tiny", tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    resp = tools_client.chat.completions.create(messages=messages, **args)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and resp.choices[0].finish_reason == "stop"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}

    chunks = list(tools_client.chat.completions.create(messages=messages, stream=True, **args))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert chunks[-1].choices[0].finish_reason == "stop"

    # the call and its result go back in: an assistant message with content null, then a tool message
    follow = tools_client.chat.completions.create(model="tiny", tools=[WEATHER], max_tokens=5, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}])
    assert follow.choices[0].message.role == "assistant" and follow.usage.prompt_tokens > resp.usage.prompt_tokens


def test_llama3_json_calls_forced_parsed_and_streamed(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir, max_model_len=1024)
    cfg.server.chat_template, cfg.server.tool_call_parser = "hermes_tools", "llama3_json"
    with live_server(cfg) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        args = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, TIME],
                    tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
        resp = client.chat.completions.create(**args)
        (call,) = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
        streamed = [d for chunk in client.chat.completions.create(stream=True, **args)
                    for d in chunk.choices[0].delta.tool_calls or []]
        assert [(d.function.name, d.function.arguments) for d in streamed] == [(call.function.name,
                                                                                call.function.arguments)]

