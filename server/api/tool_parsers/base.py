"""The parser interface, the JSON call both formats write, and the streaming follower of tag-delimited formats."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from server.api.protocol import FunctionCall, Tool, ToolCall


def tool_call(name: str, arguments) -> ToolCall:
    """A ToolCall with the arguments serialised as OpenAI sends them (a JSON object in a string)."""
    return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def json_call(data: Any) -> ToolCall | None:
    """A call from `{"name": ..., "arguments" | "parameters": {...}}` (arguments may come serialised); None if
    `data` is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models serialise the arguments themselves
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return tool_call(data["name"], arguments)


def call_schemas(tools: list[Tool], arguments_key: str) -> dict:
    """The JSON schema of one call to any of `tools`, its arguments under `arguments_key`."""
    schemas = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                "properties": {"name": {"const": t.function.name},
                               arguments_key: t.function.parameters or {"type": "object"}}} for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class ToolCallStream:
    """Follows a streamed reply: `feed` each delta, then `finish`; both give (content to emit now, calls completed)."""

    def __init__(self):
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class ToolParser:
    """How a model writes tool calls: parse a finished reply, follow a streamed one, force calls by grammar."""

    name: ClassVar[str]
    # the format's markers are special tokens: a reply to a request with tools is decoded keeping them
    keeps_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, or None when only calls were written; calls); a reply whose calls do not parse stays content."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance dialect) whose sentences are one call (or several if parallel)."""
        raise NotImplementedError


class TaggedToolParser(ToolParser):
    """A format where each call is a JSON object between `start` and `end` tags."""

    start: ClassVar[str]
    end: ClassVar[str]

    def parse_call(self, body: str) -> ToolCall | None:
        """One call from the text between the tags; None if it is not a valid call."""
        try:
            return json_call(json.loads(body))
        except ValueError:
            return None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the first call or None, calls); text with a malformed call stays content."""
        if self.start not in text:
            return text, []
        content, _, rest = text.partition(self.start)
        calls = []
        blocks = rest.split(self.start)
        for i, block in enumerate(blocks):
            body, closed, _ = block.partition(self.end)
            call = self.parse_call(body)
            if call is None and not closed and i == len(blocks) - 1 and calls:
                break  # a last call cut off by max_tokens: keep the complete ones
            if call is None:
                return text, []
            calls.append(call)
        return (content.strip() or None), calls

    def stream(self) -> "TaggedCallStream":
        return TaggedCallStream(self)


class TaggedCallStream(ToolCallStream):
    """Content passes through, except what may be the start of a call, and each call is emitted whole once its
    end tag (or the end of the stream) arrives."""

    def __init__(self, parser: TaggedToolParser):
        super().__init__()
        self.parser = parser
        self.buffer = ""
        self.in_call = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.parser.start)
                if at == -1:
                    keep = partial_suffix(self.buffer, self.parser.start)
                    if not self.calls:  # text after a call is dropped, as extract() drops it
                        content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.buffer[:at] if not self.calls else ""
                self.buffer = self.buffer[at + len(self.parser.start):]
                self.in_call = True
            at = self.buffer.find(self.parser.end)
            if at == -1:
                return content, calls
            body = self.buffer[:at]
            call = self.parser.parse_call(body)
            self.buffer = self.buffer[at + len(self.parser.end):]
            self.in_call = False
            if call is not None:
                calls.append(call)
                self.calls.append(call)
            elif not self.calls:  # not a call after all: its text is content, as extract() keeps it
                content += self.parser.start + body + self.parser.end

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the stream: an unclosed call if it parses, else the held-back text as content."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            call = self.parser.parse_call(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return ("" if self.calls else self.parser.start + rest), []  # as extract(): a cut-off last call
        return ("" if self.calls else rest), []


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
