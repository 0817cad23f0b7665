"""Pythonic calls (vLLM's `pythonic` parser): the reply is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time(zone="CET")]`, perhaps between Llama 4's `<|python_start|>` and
`<|python_end|>`. Llama 3.2's small models call tools more reliably this way than in JSON (with a template that asks
for it: `--chat-template llama3_pythonic`, bundled).

Arguments are Python literals; JSON's true, false and null are read as True, False and None (a forced call writes its
arguments as JSON values, valid for each parameter's schema).
"""

from __future__ import annotations

import ast
import io
import json
import tokenize

from server.api.protocol import Tool, ToolCall
from server.api.tool_parsers.base import ToolCallStream, ToolParser, tool_call
from server.engine.json_grammar import lark_json

_START, _END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_SALVAGE_TRIES = 4  # cut-off lists: how many of the last complete calls' ends are tried


def _value(node: ast.expr):
    """A keyword argument's value: a Python literal, JSON's true / false / null inside it too."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):  # {**other}
            raise ValueError("a dict unpacked into another is no literal")
        return {_value(key): _value(value) for key, value in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _body(text: str) -> str:
    """The reply without surrounding whitespace and Llama 4's python tags."""
    body = text.strip()
    body = body[len(_START):] if body.startswith(_START) else body
    body = body[:-len(_END)] if body.endswith(_END) else body
    return body.strip()


def parse_calls(text: str) -> list[ToolCall] | None:
    """The calls of a reply that is a Python list of calls (keyword arguments only), or None for any other text."""
    try:
        tree = ast.parse(_body(text), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError):
            return None
        if len(arguments) != len(node.keywords):  # f(**kwargs)
            return None
        calls.append(tool_call(node.func.id, arguments))
    return calls


def _closings(body: str) -> tuple[int | None, list[int]]:
    """Where the Python list that opens `body` closes (the index after its `]`; None while it is open or cannot be
    read as Python), and where each of its calls closed before that (after each `)` back at the list's level):
    brackets inside strings are not counted."""
    starts = [0]  # each line's offset: tokenize gives (line, column) positions
    for line in body.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    depth, elements = 0, []
    try:
        for token in tokenize.generate_tokens(io.StringIO(body).readline):
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth -= 1
                at = starts[token.end[0] - 1] + token.end[1]
                if depth == 0:
                    return at, elements
                if depth == 1 and token.string == ")":
                    elements.append(at)
    except (tokenize.TokenError, SyntaxError):  # an open string or bracket at the end: not closed
        pass
    return None, elements


def first_calls(text: str) -> list[ToolCall] | None:
    """The calls of the list a reply opens with, once it has closed (what follows it is dropped, as text after the
    calls of the other formats is), or None."""
    body = _body(text)
    end = _closings(body)[0] if body.startswith("[") else None
    return parse_calls(body[:end]) if end else None


def salvaged_calls(text: str) -> list[ToolCall] | None:
    """The complete calls of a list cut off before it closed (by max_tokens), or None."""
    body = _body(text)
    if not body.startswith("["):
        return None
    # the longest run of whole calls first; a few tries (a run that does not read as calls stays unreadable shorter)
    for end in reversed(_closings(body)[1][-_SALVAGE_TRIES:]):
        calls = parse_calls(body[:end] + "]")
        if calls:
            return calls
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = first_calls(text) or salvaged_calls(text)
        return (None, calls) if calls else (text, [])

    def stream(self) -> "PythonicCallStream":
        return PythonicCallStream()

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        """Calls by name, each with its required parameters in the schema's order, as JSON values of their schemas."""
        rules = []
        for i, tool in enumerate(tools):
            schema = tool.function.parameters or {}
            properties = schema.get("properties", {})
            parts = [json.dumps(tool.function.name + "(")]
            for k, name in enumerate(schema.get("required", [])):
                parts += [json.dumps((", " if k else "") + name + "="), lark_json(properties.get(name, {}))]
            rules.append(f"call_{i}: " + " ".join(parts + [json.dumps(")")]))
        calls = 'call (", " call)*' if parallel else "call"
        names = " | ".join(f"call_{i}" for i in range(len(tools)))
        return "\n".join([f'start: "[" {calls} "]"', f"call: {names}", *rules]) + "\n"


class PythonicCallStream(ToolCallStream):
    """Holds a reply back while it may be a list of calls (it opens with `[` or the python tag) and emits the calls
    once the list closes; a reply that opens otherwise streams as content."""

    def __init__(self):
        super().__init__()
        self.buffer = ""
        self.mode = "undecided"  # then "content" or "calls"
        # brackets opened minus closed so far, strings not told apart: the list is read (with strings told apart)
        # only once this comes back to 0, not at every `]` (a long reply would be read again and again)
        self.depth = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if not head or (_START.startswith(head) and head != _START):
                return "", []  # may still become a list of calls
            self.mode = "calls" if _body(head).startswith("[") or head == _START else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return out, []
        if self.calls:
            return "", []
        closed = False
        for char in delta:  # (what an undecided reply held back is whitespace or the python tag: no brackets)
            self.depth += (char in "([{") - (char in ")]}")
            closed = closed or (self.depth <= 0 and char in ")]}")
        if not closed:
            return "", []
        calls = first_calls(self.buffer) or []
        self.calls += calls
        return "", calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the stream: the complete calls of a list cut off before it closed, or else the held-back
        reply as content (calls of a closed list went out when its `]` came)."""
        if self.mode == "content" or self.calls:
            return "", []
        calls = salvaged_calls(self.buffer) if self.mode == "calls" else None
        if calls:
            self.calls += calls
            return "", calls
        return self.buffer, []
