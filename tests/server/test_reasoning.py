"""Reasoning parsers: a thinking model's <think>...</think> goes to `reasoning`, streamed or not, as vLLM sends it."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from server.api.reasoning import get_reasoning_parser
from server.runtime import load_tokenizer
from support import live_server, scripted_loader, tiny_config

REPLIES = ["<think>Let me see.</think>The answer.", "  <think>\nhm</think>\n\nYes", "no tags at all",
           "<think>cut off while thinking", "still thinking</think>done", "<think></think>", "<thi", "", "a</think>",
           "<think>x</thi"]


@pytest.mark.parametrize("name, text, expected", [
    ("deepseek_r1", "<think>Let me see.</think>The answer.", ("Let me see.", "The answer.")),
    ("deepseek_r1", "Let me see.</think>The answer.", ("Let me see.", "The answer.")),  # <think> was in the prompt
    ("deepseek_r1", "cut off while thinking", ("cut off while thinking", None)),
    ("qwen3", "<think>Let me see.</think>The answer.", ("Let me see.", "The answer.")),
    ("qwen3", "\n<think>\nhm\n</think>\n\nYes", ("\nhm\n", "\n\nYes")),
    ("qwen3", "The answer.", (None, "The answer.")),  # thinking switched off: all content
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "<think></think>Yes", (None, "Yes")),
])
def test_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_stream_sends_what_the_whole_reply_splits_into(name):
    """However the reply is cut into deltas (a tag split across them included), the parts add up to split()'s."""
    parser = get_reasoning_parser(name)
    rng = random.Random(0)
    for text in REPLIES:
        reasoning, content = parser.split(text)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            stream, got = parser.stream(), [[], []]
            for piece in pieces:
                for part, sent in zip(got, stream.feed(piece)):
                    part.append(sent)
            for part, sent in zip(got, stream.finish()):
                part.append(sent)
            assert ("".join(got[0]) or None, "".join(got[1]) or None) == (reasoning, content), (text, pieces)


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("r2")


# ---- served ---------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Is 9.11 bigger than 9.8?"}]
SCRIPT = "<think>Compare the tenths: 1 < 8.</think>No, 9.8 is bigger."


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_len = len(tok.encode(text, add_special_tokens=False))  # as the server tokenizes a rendered chat
    return scripted_loader(prompt_len, tok.encode(SCRIPT, add_special_tokens=False), tok.eos_token_id)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_served_reasoning_streamed_or_not(tiny_model_dir, scripted, parser):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.reasoning_parser = parser
    with live_server(cfg, loader=scripted) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0)
        message = client.chat.completions.create(**kw).choices[0].message
        assert message.model_extra["reasoning"] == "Compare the tenths: 1 < 8."
        assert message.content == "No, 9.8 is bigger."
        chunks = list(client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "Compare the tenths: 1 < 8."
        assert "".join(d.content or "" for d in deltas) == "No, 9.8 is bigger."
        assert not any((d.model_extra or {}).get("reasoning") and d.content for d in deltas)  # one part a delta
        # an earlier reply's reasoning sent back is accepted under either name
        history = [*MESSAGES, {"role": "assistant", "content": "No.", "reasoning_content": "1 < 8"},
                   {"role": "user", "content": "Sure?"}]
        assert client.chat.completions.create(model="tiny", messages=history, max_tokens=1).choices


def test_without_a_parser_the_reply_is_all_content(tiny_model_dir, scripted):
    with live_server(tiny_config(tiny_model_dir), loader=scripted) as live:
        body = httpx.post(f"{live.url}/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 60, "temperature": 0}).json()
    assert body["choices"][0]["message"]["content"] == SCRIPT and "reasoning" not in body["choices"][0]["message"]


def test_responses_api_gives_the_reasoning_its_own_item(tiny_model_dir, scripted):
    cfg = tiny_config(tiny_model_dir)
    cfg.server.reasoning_parser = "deepseek_r1"
    with live_server(cfg, loader=scripted) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", input=MESSAGES, max_output_tokens=60, temperature=0)
        resp = client.responses.create(**kw)
        thought, said = resp.output
        assert thought.type == "reasoning" and thought.content[0].text == "Compare the tenths: 1 < 8."
        assert said.type == "message" and resp.output_text == "No, 9.8 is bigger." and resp.status == "completed"
        tok = load_tokenizer(tiny_model_dir)
        thinking_tokens = len(tok.encode("Compare the tenths: 1 < 8.", add_special_tokens=False))
        assert resp.usage.output_tokens_details.reasoning_tokens == thinking_tokens
        events = list(client.responses.create(stream=True, **kw))
        kinds = [e.type for e in events]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought.content[0].text
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
        final = events[-1].response
        assert [i.type for i in final.output] == ["reasoning", "message"] and final.output[0].status == "completed"
        assert final.usage.output_tokens_details.reasoning_tokens == thinking_tokens
        # cut off while thinking: the reasoning alone, incomplete
        short = client.responses.create(**{**kw, "max_output_tokens": 5})
        assert [i.type for i in short.output] == ["reasoning"] and short.output[0].status == "incomplete"
        streamed = list(client.responses.create(stream=True, **{**kw, "max_output_tokens": 5}))
        assert [i.type for i in streamed[-1].response.output] == ["reasoning"]
        assert streamed[-1].type == "response.incomplete"
        # the reasoning item sent back is accepted (and listed among the input items)
        again = client.responses.create(model="tiny", input=[*MESSAGES, thought.model_dump(exclude_none=True),
                                                             {"role": "user", "content": "Sure?"}], max_output_tokens=1)
        assert [i.type for i in client.responses.input_items.list(again.id, order="asc").data] == [
            "message", "reasoning", "message"]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_structured_output_applies_once_the_reasoning_ends(tiny_model_dir, parser):
    """The reply thinks freely (here: forced to), then its content keeps to the constraint (the model's own logits
    under a choice grammar)."""
    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    thought = "<think>Compare the tenths: 1 < 8.</think>"
    loader = scripted_loader(len(tok.encode(text, add_special_tokens=False)),
                              tok.encode(thought, add_special_tokens=False), None)
    cfg = tiny_config(tiny_model_dir)
    cfg.server.reasoning_parser = parser
    with live_server(cfg, loader=loader) as live:
        body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.0, "seed": 5,
                "structured_outputs": {"choice": ["yes", "no"]}}
        message = httpx.post(f"{live.url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning"] == "Compare the tenths: 1 < 8." and message["content"] in ("yes", "no")
        # thinking switched off in the prompt (Qwen3's template writes an empty block): constrained from the start
        # (a longer prompt: the script forces only the tokens right after the first prompt's length)
        closed = [{"role": "system", "content": "Answer in one word. " * 8}, *MESSAGES,
                  {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
        off = httpx.post(f"{live.url}/v1/chat/completions", json={
            **body, "messages": closed, "continue_final_message": True, "add_generation_prompt": False}).json()
        assert off["choices"][0]["message"]["content"] in ("yes", "no")
        assert off["choices"][0]["message"].get("reasoning") is None

