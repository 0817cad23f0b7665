"""How structured output writes JSON: the grammar options every JSON constraint uses, and Lark fragments under them.

A module of its own, free of llguidance and torch, so the tool-call parsers (which write Lark grammars) import in a
fraction of a second: `neuronmm serve` checks a parser's name before it spawns the engine core.
"""

from __future__ import annotations

import json

# json.dumps-style separators and no free whitespace: what models write, and no room for the endless
# runs of spaces or newlines that small models fall into when a grammar allows them; keywords
# llguidance does not implement are ignored rather than refused.
JSON_OPTIONS = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def lark_json(schema: dict) -> str:
    """A Lark fragment matching JSON for `schema`, under the same options as json_schema specs."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})
