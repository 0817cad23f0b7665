"""Llama 3.x JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`, several joined by "; ", perhaps
after `<|python_tag|>` (the template of Llama 3.1-3.3 asks for this form when tools are given)."""

from __future__ import annotations

import json

from server.api.protocol import Tool, ToolCall
from server.api.tool_parsers.base import ToolCallStream, ToolParser, call_schemas, json_call
from server.engine.json_grammar import lark_json

_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n;"


def _next_call(body: str, at: int) -> tuple[ToolCall | None, int] | None:
    """The call whose JSON starts at or after `at` (None as the call if it is JSON but no call), and where it
    ends; None if no complete JSON value is there yet."""
    while at < len(body) and body[at] in _SEPARATORS:
        at += 1
    try:
        data, end = _DECODER.raw_decode(body, at)
    except ValueError:
        return None
    return json_call(data), end


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def call_body(self, text: str) -> str | None:
        """The text after an optional python tag if it opens a JSON object (a call), else None (plain content)."""
        body = text.lstrip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        return body if body.startswith("{") else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self.call_body(text)
        if body is None:
            return text, []
        calls, at = [], 0
        while at < len(body.rstrip(_SEPARATORS)):
            found = _next_call(body, at)
            if found is None:
                break  # a last call cut off by max_tokens, or text after the calls: the complete ones count
            call, at = found
            if call is None:
                return text, []  # JSON that is no call: the reply is content
            calls.append(call)
        return (None, calls) if calls else (text, [])

    def stream(self) -> "JsonCallStream":
        return JsonCallStream(self)

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        calls = 'call ("; " call)*' if parallel else "call"
        return f"start: {calls}\ncall: {lark_json(call_schemas(tools, 'parameters'))}\n"


class JsonCallStream(ToolCallStream):
    """Holds the reply back while it may be a call (it opens with `{` or the python tag), emitting each call once
    its JSON closes; a reply that opens otherwise streams as content."""

    def __init__(self, parser: Llama3JsonToolParser):
        super().__init__()
        self.parser = parser
        self.buffer = ""
        self.mode = "undecided"  # then "content" or "calls"
        self.cursor = 0  # where the next call starts in the calls' body
        self.broken = False  # JSON that is no call: the reply is content after all

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or (self.parser.tag.startswith(head) and head != self.parser.tag):
                return "", []  # may still become a call
            self.mode = "calls" if head.startswith((self.parser.tag, "{")) else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._complete_calls()

    def _complete_calls(self) -> list[ToolCall]:
        body = self.parser.call_body(self.buffer)
        calls = []
        while body is not None and not self.broken:
            found = _next_call(body, self.cursor)
            if found is None:
                break
            if found[0] is None:
                self.broken = True
                break
            calls.append(found[0])
            self.cursor = found[1]
        self.calls += calls
        return calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the stream: a reply that held no call is content after all."""
        if self.mode == "content":
            return "", []
        if self.mode == "calls" and not self.calls and not self.broken:
            self._complete_calls()  # nothing new arrives: a last chance for a call the tag alone announced
        if not self.calls:
            return self.buffer, []
        return "", []
