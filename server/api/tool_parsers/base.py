"""The parser interface and the streaming follower shared by tag-delimited formats."""

from __future__ import annotations

import json
from typing import ClassVar

from server.api.protocol import FunctionCall, Tool, ToolCall


def tool_call(name: str, arguments) -> ToolCall:
    """A ToolCall with the arguments serialised as OpenAI sends them (a JSON object in a string)."""
    return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


class ToolParser:
    """A format where each call is a JSON object between `start` and `end` tags."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str]

    def parse_call(self, body: str) -> ToolCall | None:
        """One call from the text between the tags; None if it is not a valid call."""
        raise NotImplementedError

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

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        """A Lark grammar (llguidance dialect) whose sentences are one call (or several if parallel)."""
        raise NotImplementedError


class ToolCallStream:
    """Follows streamed text: content passes through, except what may be the start of a call, and each
    call is emitted whole once its end tag (or the end of the stream) arrives."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buffer = ""
        self.in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to emit now, calls completed by this delta)."""
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.parser.start)
                if at == -1:
                    keep = _partial_suffix(self.buffer, self.parser.start)
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
            call = self.parser.parse_call(self.buffer[:at])
            self.buffer = self.buffer[at + len(self.parser.end):]
            self.in_call = False
            if call is not None:
                calls.append(call)
                self.calls.append(call)

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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
