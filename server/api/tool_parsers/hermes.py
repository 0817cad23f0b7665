"""Hermes / Qwen style: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json

from server.api.protocol import Tool, ToolCall
from server.api.tool_parsers.base import ToolParser, tool_call
from server.engine.structured import lark_json


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):  # some models serialise the arguments themselves
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        return tool_call(data["name"], arguments)

    def forced_grammar(self, tools: list[Tool], parallel: bool) -> str:
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": t.function.name},
                                   "arguments": t.function.parameters or {"type": "object"}}} for t in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls}\ncall: "{self.start}\\n" {lark_json(schema)} "\\n{self.end}"\n'
