"""Mistral's calls, after its `[TOOL_CALLS]` control token: a JSON list `[{"name": ..., "arguments": {...}}, ...]`
(Mistral 7B v0.3, Mixtral 8x22B: tokenizer v3) or, from tokenizer v11 on (Mistral Small 3.2, Devstral), one
`name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]`. The token is special: replies to requests with tools
are decoded keeping special tokens (`keeps_special_tokens`), as vLLM's mistral parser has them."""

from __future__ import annotations

import json

from server.api.protocol import Tool, ToolCall
from server.api.tool_parsers.base import ToolCallStream, ToolParser, call_schemas, json_call, partial_suffix, tool_call
from server.engine.json_grammar import lark_json

_DECODER = json.JSONDecoder()
TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def _json_calls(body: str) -> list[ToolCall] | None:
    """The calls of a JSON list (or a single object) at the start of `body`; None if it is not complete calls."""
    try:
        data, _ = _DECODER.raw_decode(body)
    except ValueError:
        return None
    calls = [json_call(item) for item in (data if isinstance(data, list) else [data])]
    return calls if calls and all(c is not None for c in calls) else None


def _named_calls(segments: list[str]) -> list[ToolCall] | None:
    """`name[ARGS]{json}` segments as calls (a last one cut off is dropped); None if one is malformed."""
    calls = []
    for i, segment in enumerate(segments):
        name, found, arguments = segment.partition(ARGS)
        try:
            data, _ = _DECODER.raw_decode(arguments.strip()) if found else (None, 0)
        except ValueError:
            data = None
        if not found or not name.strip() or not isinstance(data, dict):
            if i == len(segments) - 1 and calls:
                break  # cut off by max_tokens: the complete ones count
            return None
        calls.append(tool_call(name.strip(), data))
    return calls


def parse_calls(after_tag: str) -> list[ToolCall] | None:
    """The calls written after the first `[TOOL_CALLS]` in either form; None if they do not parse."""
    body = after_tag.strip()
    if body.startswith(("[", "{")):
        return _json_calls(body)
    return _named_calls([s for s in body.split(TAG)])


class MistralToolParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` calls, in either form (see the module's docstring)."""

    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token: decoded only when special tokens are kept

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if TAG in text:
            content, _, rest = text.partition(TAG)
        elif text.lstrip().startswith("[{"):  # the bare list a forced call writes (forced_grammar)
            content, rest = "", text
        else:
            return text, []
        calls = parse_calls(rest)
        return (text, []) if not calls else ((content.strip() or None), calls)

    def stream(self) -> "MistralCallStream":
        return MistralCallStream(self)

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        # the bare JSON list (a grammar over text cannot write the control token); extract() reads it as calls
        calls = 'call (", " call)*' if parallel else "call"
        return f'start: "[" {calls} "]"\ncall: {lark_json(call_schemas(tools, "arguments"))}\n'


class MistralCallStream(ToolCallStream):
    """Content streams until `[TOOL_CALLS]` (or a reply opening a bare list); from there the reply is held and its
    calls come whole at the end of the stream."""

    def __init__(self, parser: MistralToolParser):
        super().__init__()
        self.parser = parser
        self.sent = ""  # content already emitted
        self.held = ""  # from the tag (or a possible start of it) on

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.held += delta
        if TAG in self.held or (not self.sent and self.held.lstrip().startswith("[")):
            return "", []  # calls, or a bare list's start: held to the end
        keep = partial_suffix(self.held, TAG)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, held = self.sent + self.held, self.held
        self.held = ""
        _, calls = self.parser.extract(text)
        if not calls:  # not calls after all: what was held is content
            return held, []
        self.calls += calls
        return text.partition(TAG)[0][len(self.sent):] if TAG in text else "", calls
