"""Anthropic's Messages API (POST /v1/messages) through the official anthropic client: the chat path's answer as
content blocks and stop reasons, streamed as the API's events."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.api.chat_templates import load_chat_template
from server.runtime import load_tokenizer
from support import live_server, scripted_loader, tiny_config

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_message_is_the_chat_reply_as_content_blocks(client, server):
    system = "Answer in one word."
    message = client.messages.create(model="tiny", max_tokens=8, system=system, messages=USER,
                                     extra_body={"temperature": 0})
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": system}, *USER]}).json()
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    prompt = chat["usage"]["prompt_tokens"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt
    counted = client.messages.count_tokens(model="tiny", system=system, messages=USER)
    assert counted.input_tokens == prompt


def test_count_tokens_counts_the_prompt_whatever_unknown_fields_come_with_it(server):
    """count_tokens takes no sampling fields: one sent anyway, of any type (a fuzzed `"temperature": []`), is an
    unknown field set aside as elsewhere, never a 500 from the Messages request the count is rendered through."""
    body = {"model": "tiny", "messages": USER}
    plain = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body)
    odd = httpx.post(f"{server.url}/v1/messages/count_tokens", json={**body, "temperature": [], "max_tokens": "x"})
    assert plain.status_code == odd.status_code == 200
    assert odd.json()["input_tokens"] == plain.json()["input_tokens"] > 0


def test_a_last_assistant_message_is_a_prefill_the_reply_continues(client, server):
    """Anthropic's prefilled response: the reply goes on from the assistant's text, as chat's continue_final_message
    has it."""
    prefill = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    message = client.messages.create(model="tiny", max_tokens=6, messages=prefill, extra_body={"temperature": 0})
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 6, "temperature": 0, "messages": prefill, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_thinking_switch_reaches_the_chat_template(tiny_model_dir):
    """Anthropic's thinking {"type": "disabled"} as the template's enable_thinking (Qwen3's switch): a template that
    reads it renders a different prompt."""
    template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    path = tiny_model_dir.parent / "thinking_switch.jinja"
    path.write_text(template)
    cfg = tiny_config(tiny_model_dir)
    cfg.server.chat_template = str(path)
    with live_server(cfg) as live:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        counts = {kind: client.messages.count_tokens(model="tiny", messages=USER, thinking={"type": kind}).input_tokens
                  for kind in ("enabled", "disabled")}
    assert counts["disabled"] > counts["enabled"]


def test_streamed_events_give_the_same_message(client):
    kw = dict(model="tiny", max_tokens=8, messages=USER, extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")


def _scripted_server(tiny_model_dir, reply: str, **server_cfg):
    """A live server whose model writes `reply` to USER (then EOS), under the given server settings."""
    cfg = tiny_config(tiny_model_dir)
    for key, value in server_cfg.items():
        setattr(cfg.server, key, value)
    tok = load_tokenizer(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    chat_template = load_chat_template(server_cfg.get("chat_template"))  # as the server renders the prompt
    text = tok.apply_chat_template(USER, tools=tools if chat_template else None, chat_template=chat_template,
                                   add_generation_prompt=True, tokenize=False)
    loader = scripted_loader(len(tok.encode(text, add_special_tokens=False)),
                             tok.encode(reply, add_special_tokens=False), tok.eos_token_id)
    return live_server(cfg, loader=loader)


def test_a_tool_call_is_a_tool_use_block(tiny_model_dir):
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    with _scripted_server(tiny_model_dir, reply, chat_template="hermes_tools") as live:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        kw = dict(model="tiny", max_tokens=60, messages=USER, tools=[WEATHER], extra_body={"temperature": 0})
        message = client.messages.create(**kw)
        (use,) = message.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        assert message.stop_reason == "tool_use"
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"
        # the call and its result sent back: a tool message to the template, as chat has it
        history = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                              "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
        assert client.messages.create(model="tiny", max_tokens=2, messages=history, tools=[WEATHER]).content


def test_thinking_and_stop_sequences(tiny_model_dir):
    reply = "<think>It is sunny there.</think>Sunny. STOP and more"
    with _scripted_server(tiny_model_dir, reply, reasoning_parser="deepseek_r1") as live:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
        kw = dict(model="tiny", max_tokens=60, messages=USER, stop_sequences=["STOP"],
                  extra_body={"temperature": 0})
        message = client.messages.create(**kw)
        thinking, said = message.content
        assert thinking.type == "thinking" and thinking.thinking == "It is sunny there."
        assert said.type == "text" and said.text == "Sunny. "
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Sunny. "
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "STOP"


def test_structured_output_follows_the_schema(client):
    """Anthropic's output_config.format (structured outputs) as constrained decoding: the reply parses."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    message = client.messages.create(model="tiny", max_tokens=40, messages=USER,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(message.content[0].text)["city"] in ("Paris", "Rome") and message.stop_reason == "end_turn"


@pytest.mark.parametrize("body, says", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "image blocks are not supported"),
    ({"max_tokens": 4, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "needs a name"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": USER, "model": "other"}, "does not exist"),
])
def test_bad_requests_are_4xx(server, body, says):
    resp = httpx.post(f"{server.url}/v1/messages", json={"model": "tiny", **body})
    assert resp.status_code in (400, 404) and says in resp.json()["error"]["message"], resp.text


def test_an_api_key_in_anthropics_header(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.api_key = "sekret"
    with live_server(cfg) as live:
        good = anthropic.Anthropic(base_url=live.url, api_key="sekret", max_retries=0)  # sends x-api-key
        assert good.messages.create(model="tiny", max_tokens=1, messages=USER).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=1, messages=USER)
