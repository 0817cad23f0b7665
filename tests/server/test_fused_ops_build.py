"""Building the fused CPU ops: a compiler that fails leaves no library behind, only a message naming the source."""

from __future__ import annotations

import pytest

from server.models import fused_ops


def test_a_failed_build_names_the_source_and_leaves_nothing(tmp_path, monkeypatch):
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'error: no such thing' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    target = tmp_path / "cache" / "fused_ops.so"
    with pytest.raises(RuntimeError, match=r"compiling \w+\.cpp failed: error: no such thing"):
        fused_ops._compile(target)
    assert list((tmp_path / "cache").iterdir()) == []  # neither the library nor the objects' folder
