"""A streamed chunk that carries only new text is written from a template (TextDeltaLines): each such line is the
line pydantic gives for the same chunk, byte for byte, and the other chunks still come from the models."""

from __future__ import annotations

import json

import httpx
import pytest

from server.api.protocol import ChatDelta, ChatStreamChoice, CompletionChoice, StreamChunk, TextDeltaLines
from support import live_server, tiny_config

# every escape JSON has, the line breaks `sse` escapes, quotes, non-ASCII (2-4 bytes in UTF-8), and the placeholder
TEXTS = ["", " the", 'say "hi"\\', "\x00\x07\x08\t\n\x0b\x0c\r\x1b\x1f\x7f", "\x85 \u2028 \u2029", "naïve 漢字 😀",
         "\x00text\x00", "".join(map(chr, range(0x20, 0x3000)))]
CHOICES = {"text_completion": lambda index, text: CompletionChoice(index=index, text=text),
           "chat.completion.chunk": lambda index, text: ChatStreamChoice(index=index, delta=ChatDelta(content=text))}


@pytest.mark.parametrize("obj", CHOICES)
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("model", ["tiny", 'a "quoted" \x00text\x00 name'])
def test_a_template_line_is_pydantics_line(obj, include_usage, model):
    head = StreamChunk(id="cmpl-1", object=obj, created=1700000000, model=model, choices=[])
    lines = TextDeltaLines(head, include_usage, CHOICES[obj])
    for index in (0, 3, 0):
        for text in TEXTS:
            chunk = head.model_copy(update={"choices": [CHOICES[obj](index, text)]})
            assert lines.line(index, text) == chunk.sse(include_usage)


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with live_server(tiny_config(tiny_model_dir, max_model_len=512)) as live:
        yield live.url


def _data_lines(url: str, route: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        return [line for line in reply.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("route, body", [
    ("completions", {"prompt": "Once upon a time", "n": 2, "echo": True,
                     "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": "Once upon a time", "logprobs": 1}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}], "n": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}], "return_token_ids": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
])
def test_streamed_lines_are_the_models_lines(url, route, body, monkeypatch):
    written = []
    line = TextDeltaLines.line
    monkeypatch.setattr(TextDeltaLines, "line", lambda self, index, text: written.append(text) or line(self, index,
                                                                                                         text))
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True, **body}
    lines = _data_lines(url, route, body)
    include_usage = "stream_options" in body
    for data in lines:
        assert data + "\n\n" == StreamChunk.model_validate(json.loads(data[6:])).sse(include_usage)
    # text-only chunks after each choice's first: from the template, unless a chunk carries more (logprobs, token
    # ids, the usage so far)
    plain = "logprobs" not in body and "return_token_ids" not in body
    assert len(written) == (body.get("n", 1) * 10 if plain else 0)
