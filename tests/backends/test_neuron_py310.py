"""The Neuron image runs the serving code on the DLC's Python 3.10: keep the serving path 3.10-clean."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = sorted(p for d in ("server", "neuronmm_kernels") for p in (ROOT / d).rglob("*.py"))
# Names that exist only from 3.11: importing or using them would fail at start-up in the image.
PY311_ONLY = {("datetime", "UTC"), ("typing", "Self"), ("typing", "LiteralString"), ("typing", "Never"),
              ("typing", "assert_never"), ("typing", "reveal_type"), ("enum", "StrEnum"), ("asyncio", "TaskGroup"),
              ("asyncio", "timeout")}


@pytest.mark.parametrize("path", SERVING, ids=lambda p: str(p.relative_to(ROOT)))
def test_serving_module_is_python_310(path):
    source = path.read_text()
    tree = ast.parse(source, feature_version=(3, 10))  # rejects 3.11+ grammar such as except*
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name for a in node.names} & {"tomllib"}, f"{path.name}: tomllib is 3.11+"
        elif isinstance(node, ast.ImportFrom) and node.module:
            bad = {(node.module, a.name) for a in node.names} & PY311_ONLY
            assert not bad, f"{path.name}:{node.lineno} imports {bad} (3.11+)"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert (node.value.id, node.attr) not in PY311_ONLY, f"{path.name}:{node.lineno} uses " \
                                                                  f"{node.value.id}.{node.attr} (3.11+)"
        elif isinstance(node, ast.TryStar):
            raise AssertionError(f"{path.name}:{node.lineno} uses except* (3.11+)")
