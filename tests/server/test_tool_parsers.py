"""Tool-call parsers: finished replies, streamed replies split anywhere, and the grammars that force calls."""

from __future__ import annotations

import json

import httpx
import llguidance
import openai
import pytest
from transformers import AutoTokenizer

from bench.harness import make_tiny_model
from server.api.protocol import Tool
from server.api.chat_templates import load_chat_template
from server.api.tool_parsers import PARSERS, get_tool_parser, pythonic
from support import live_server, scripted_loader, tiny_config

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})

# (parser, reply, expected content, expected calls as (name, arguments))
CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Sure.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '"{\\"x\\": 1}"}</tool_call>', None, [("a", {}), ("b", {"x": 1})]),
    ("hermes", "No tools needed: 3 < 4.", "No tools needed: 3 < 4.", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", '  {"name": "a", "parameters": {}}\n', None, [("a", {})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "param', None, [("a", {})]),  # cut off
    ("llama3_json", "Paris is sunny {today}.", "Paris is sunny {today}.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call: content
    ("llama3_json", "{not json", "{not json", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "b", "arguments": '
                '{}}]', None, [("get_weather", {"city": "Paris"}), ("b", {})]),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "a", "arguments": "{\\"x\\": 1}"}]', "Let me look.",
     [("a", {"x": 1})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]{}', None,  # tokenizer v11 on
     [("get_weather", {"city": "Paris"}), ("b", {})]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": ', None, [("a", {})]),  # cut off
    ("mistral", '[{"name": "a", "arguments": {}}]', None, [("a", {})]),  # the bare list a forced call writes
    ("mistral", "[1] is the first item.", "[1] is the first item.", []),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "Paris is sunny.", "Paris is sunny.", []),
    ("pythonic", '[get_weather(city="Paris"), b(x=1, y=[1, -2.5], z={"k": None}, w=True)]', None,
     [("get_weather", {"city": "Paris"}), ("b", {"x": 1, "y": [1, -2.5], "z": {"k": None}, "w": True})]),
    ("pythonic", '<|python_start|>[a(x=true, y=null)]<|python_end|>', None, [("a", {"x": True, "y": None})]),  # JSON's
    ("pythonic", ' [a(s="]"), b()]\n', None, [("a", {"s": "]"}), ("b", {})]),
    ("pythonic", "[a()] and then text", None, [("a", {})]),  # text after the closed list is dropped
    ("pythonic", "[1, 2] are numbers.", "[1, 2] are numbers.", []),
    ("pythonic", "[a(1)]", "[a(1)]", []),  # positional arguments: not a call list
    ("pythonic", '[a(x=f())]', '[a(x=f())]', []),  # not a literal
    ("pythonic", '[a(x=1), b(y="(", z=', None, [("a", {"x": 1})]),  # cut off: the complete calls count
    ("pythonic", "[a(x=", "[a(x=", []),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_extract(name, reply, content, calls):
    got_content, got_calls = get_tool_parser(name).extract(reply)
    assert got_content == content and _calls(got_calls) == calls


@pytest.mark.parametrize("split", [1, 2, 3, 7])
@pytest.mark.parametrize("name, reply, content, calls", CASES)
def test_a_stream_split_anywhere_gives_what_extract_gives(name, reply, content, calls, split):
    follower = get_tool_parser(name).stream()
    streamed_text, streamed_calls = "", []
    for at in range(0, len(reply), split):
        text, new = follower.feed(reply[at:at + split])
        streamed_text, streamed_calls = streamed_text + text, streamed_calls + new
    text, new = follower.finish()
    streamed_text, streamed_calls = streamed_text + text, streamed_calls + new
    assert _calls(streamed_calls) == calls and _calls(follower.calls) == calls
    assert streamed_text.strip() == (content or "")  # a stream cannot take back the space before a call


def test_llama3_calls_come_out_as_their_json_closes():
    follower = get_tool_parser("llama3_json").stream()
    assert follower.feed('{"name": "a", "parameters": {"x": 1}') == ("", [])
    text, calls = follower.feed('}; {"name": "b", ')
    assert text == "" and _calls(calls) == [("a", {"x": 1})]
    text, calls = follower.feed('"parameters": {}}')
    assert _calls(calls) == [("b", {})] and follower.finish() == ("", [])


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_grammars_accept_what_the_parser_reads_back(smol_dir, name, parallel):
    """Each parser's forced grammar compiles, and the calls it allows parse back to the same calls."""
    parser = get_tool_parser(name)
    grammar = parser.forced_grammar([WEATHER, TIME], parallel)
    assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    key = "parameters" if name == "llama3_json" else "arguments"
    one = {"name": "get_weather", key: {"city": "Paris"}}
    two = {"name": "get_time", key: {}}
    if name == "hermes":
        text = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in ([one, two] if parallel else [one]))
    elif name == "mistral":
        text = json.dumps([one, two] if parallel else [one])
    elif name == "pythonic":  # each call's required arguments, as JSON values
        text = '[get_weather(city="Paris"), get_time()]' if parallel else '[get_weather(city="Paris")]'
    else:
        text = "; ".join(json.dumps(c) for c in ([one, two] if parallel else [one]))
    tokenizer = AutoTokenizer.from_pretrained(smol_dir)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer),
                                   llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert matcher.try_consume_tokens(tokenizer.encode(text, add_special_tokens=False)) > 0
    assert matcher.is_accepting() and not matcher.is_error()
    assert _calls(parser.extract(text)[1]) == [("get_weather", {"city": "Paris"})] + (
        [("get_time", {})] if parallel else [])


def test_served_mistral_calls_keep_their_control_token(smol_dir, tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: under the mistral parser a reply to a request with tools is decoded
    keeping it (skipped, the calls would read as content), streamed or not."""
    tok = AutoTokenizer.from_pretrained(smol_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.save_pretrained(tmp_path / "tok")
    model_dir = make_tiny_model(tmp_path / "model", tmp_path / "tok")
    cfg = tiny_config(model_dir)
    cfg.server.tool_call_parser, cfg.server.chat_template = "mistral", "hermes_tools"
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [WEATHER.model_dump(exclude_none=True)]
    prompt = tok.apply_chat_template(messages, tools=tools, chat_template=load_chat_template("hermes_tools"),
                                     add_generation_prompt=True, tokenize=False)
    # the v11 form: without its control token it reads as text (the v3 list would still parse as a bare list)
    reply = tok.encode('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', add_special_tokens=False)
    assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in reply  # one control token, not its characters
    loader = scripted_loader(len(tok.encode(prompt, add_special_tokens=False)), reply, tok.eos_token_id)
    with live_server(cfg, loader=loader) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", messages=messages, tools=tools, max_tokens=60, temperature=0)
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert _calls([call for d in deltas for call in d.tool_calls or []]) == [("get_weather", {"city": "Paris"})]
        assert not "".join(d.content or "" for d in deltas)


def test_served_pythonic_calls_through_the_bundled_template(tiny_model_dir):
    """--tool-call-parser pythonic with the bundled llama3_pythonic template: the template lists the tools, asks for
    a Python list of calls and writes an earlier call back in that form (a tool's result in an ipython turn); a
    required call is forced into that form and comes back parsed, streamed or not."""
    cfg = tiny_config(tiny_model_dir)
    cfg.server.tool_call_parser, cfg.server.chat_template = "pythonic", "llama3_pythonic"
    tools = [WEATHER.model_dump(exclude_none=True), TIME.model_dump(exclude_none=True)]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with live_server(cfg) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        ids = httpx.post(f"{live.url}/tokenize", json={"messages": history, "tools": tools}).json()["tokens"]
        prompt = live.state.serving.tokenizer.decode(ids)
        assert '"name": "get_weather"' in prompt and "Python list of calls" in prompt
        assert '[get_weather(city="Paris", days=2)]<|eot_id|>' in prompt
        assert "ipython<|end_header_id|>\n\nsunny" in prompt
        kw = dict(model="tiny", messages=history[:1], tools=tools, tool_choice="required", max_tokens=40)
        choice = client.chat.completions.create(**kw).choices[0]
        calls = _calls(choice.message.tool_calls)
        assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
        assert all("city" in args for name, args in calls if name == "get_weather")  # its required argument
        chunks = list(client.chat.completions.create(stream=True, **kw, seed=1))
        streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
        assert streamed and all(call.function.name in ("get_weather", "get_time") for call in streamed)


def test_a_long_reply_opening_with_a_bracket_is_read_once_it_closes(monkeypatch):
    """A reply that opens like a list but is not one (thousands of `]`) is not parsed again at every `]`: the stream
    reads the list only when its brackets close (here never), and it comes out as content."""
    reply = "[" + ", ".join(f"[{i}]" for i in range(3000)) + " and more"
    parsed = []
    monkeypatch.setattr(pythonic, "first_calls", lambda text: parsed.append(len(text)))
    follower = get_tool_parser("pythonic").stream()
    for at in range(0, len(reply), 3):
        assert follower.feed(reply[at:at + 3]) == ("", [])
    assert follower.finish() == (reply, []) and parsed == []
