"""Tool-call parsers: how a model writes tool calls in its text, chosen by `server.tool_call_parser`.

A parser turns finished text into (content, tool calls), follows a stream with a `ToolCallStream`, and
writes the Lark grammar that forces calls when tool_choice is "required" or names a function. Add a
format by subclassing ToolParser (TaggedToolParser for calls between tags) and listing it in PARSERS.
"""

from __future__ import annotations

from server.api.tool_parsers.base import ToolCallStream, ToolParser
from server.api.tool_parsers.hermes import HermesToolParser
from server.api.tool_parsers.llama3_json import Llama3JsonToolParser
from server.api.tool_parsers.mistral import MistralToolParser
from server.api.tool_parsers.pythonic import PythonicToolParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                                            PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered under `name` (ValueError naming the known ones otherwise)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


__all__ = ["PARSERS", "ToolCallStream", "ToolParser", "get_tool_parser"]
