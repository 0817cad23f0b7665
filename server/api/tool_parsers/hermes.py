"""Hermes / Qwen style: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

from server.api.protocol import Tool
from server.api.tool_parsers.base import TaggedToolParser, call_schemas
from server.engine.json_grammar import lark_json


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        calls = 'call ("\\n" call)*' if parallel else "call"
        call = lark_json(call_schemas(tools, "arguments"))
        return f'start: {calls}\ncall: "{self.start}\\n" {call} "\\n{self.end}"\n'
