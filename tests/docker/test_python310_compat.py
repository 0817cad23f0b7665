"""The trn1 image runs the shipped packages on the Neuron DLC's Python 3.10: no 3.11-only syntax or stdlib names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("server", "compression", "neuronmm_kernels", "bench")  # what docker/Dockerfile.neuron copies
# Standard-library names added in 3.11 that a 3.10 interpreter lacks (the syntax check cannot see these).
PY311_NAMES = re.compile(r"datetime\.UTC\b|from datetime import .*\bUTC\b|\btomllib\b|\bStrEnum\b|\bTaskGroup\b|"
                         r"asyncio\.timeout\(|\bExceptionGroup\b|typing import .*\bSelf\b|hashlib\.file_digest")


def _sources() -> list[Path]:
    return sorted(p for pkg in SHIPPED for p in (REPO / pkg).rglob("*.py"))


def test_dockerfile_copies_the_checked_packages():
    dockerfile = (REPO / "docker" / "Dockerfile.neuron").read_text()
    assert "py310" in dockerfile, "the Neuron base image changed Python; update this test's version"
    for pkg in SHIPPED:
        assert f"COPY {pkg} " in dockerfile


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_parses_as_python_310_and_avoids_311_stdlib_names(path: Path):
    source = path.read_text()
    ast.parse(source, filename=str(path), feature_version=(3, 10))
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1) if PY311_NAMES.search(line)]
    assert not hits, f"{path.name} uses Python 3.11-only names: {hits}"
