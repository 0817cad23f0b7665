"""The artifact format: typed manifest round trip, consistency errors, atomic writes (exception and SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import server.models.artifact as art
from server.errors import ConfigError
from server.models.artifact import MANIFEST, Manifest, load_artifact, save_artifact

REPO = Path(__file__).resolve().parents[2]


def _manifest_dict():
    return {"format_version": 1, "source": {"sha256": "x"}, "modules": {
        "model.layers.0.mlp.down_proj": {"rank": 4, "in": 16, "out": 8, "rel_error": 0.1},
        "model.layers.0.mlp.up_proj": {"dense": True, "reason": "no gain", "in": 8, "out": 16}}}


def _manifest(**changes) -> Manifest:
    return Manifest.model_validate({**_manifest_dict(), **changes})


def _tensors():
    torch.manual_seed(0)
    return {"model.layers.0.mlp.down_proj.A": torch.randn(4, 16), "model.layers.0.mlp.down_proj.B": torch.randn(8, 4)}


def test_manifest_round_trip_and_mismatch(tmp_path):
    out = tmp_path / "art"
    save_artifact(out, _manifest(), _tensors())
    manifest, tensors = load_artifact(out)
    assert manifest.to_dict() == _manifest_dict() and manifest.low_rank_modules() == ["model.layers.0.mlp.down_proj"]
    want = _tensors()
    assert set(tensors) == set(want) and all(torch.equal(tensors[k], want[k]) for k in want)
    bad = _manifest_dict()
    bad["modules"]["model.layers.0.mlp.down_proj"]["rank"] = 5
    (out / MANIFEST).write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="do not match the manifest"):
        load_artifact(out)
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_artifact(out)
    (out / MANIFEST).write_text(json.dumps({**_manifest_dict(), "format_version": 99}))
    with pytest.raises(ConfigError, match="format_version"):
        load_artifact(out)
    with pytest.raises(ConfigError, match="needs"):
        load_artifact(tmp_path / "absent")


def test_interrupted_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    out = tmp_path / "art"
    save_artifact(out, _manifest(), _tensors())
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*_a, **_k):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-write

    monkeypatch.setattr(safetensors.torch, "save_file", boom)  # save_artifact imports it when it writes
    with pytest.raises(KeyboardInterrupt):
        save_artifact(out, _manifest(method="new"), _tensors())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["art"]
    with pytest.raises(KeyboardInterrupt):
        save_artifact(tmp_path / "fresh", _manifest(), _tensors())
    assert not (tmp_path / "fresh").exists() and sorted(os.listdir(tmp_path)) == ["art"]


_CHILD = textwrap.dedent("""
    import sys, time, torch
    import safetensors.torch
    import server.models.artifact as art
    from server.models.artifact import Manifest
    real = safetensors.torch.save_file
    def slow(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as fh:
            fh.truncate(100)  # a half-written factors file
        open(sys.argv[2], "w").close()  # tell the parent we are mid-write
        time.sleep(60)
    safetensors.torch.save_file = slow
    art.save_artifact(sys.argv[1], Manifest(format_version=1, modules={}, method="new"),
                      {"m.A": torch.ones(2, 3)})
""")


def test_sigkill_mid_write_leaves_old_artifact(tmp_path):
    out = tmp_path / "art"
    save_artifact(out, _manifest(modules={}, method="old"), {})
    marker = tmp_path / "mid-write"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(out), str(marker)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "child never reached the write"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    manifest, tensors = load_artifact(out)
    assert manifest.method == "old" and tensors == {}
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "factors.safetensors"])
    # The next write replaces it cleanly despite the dead writer's leftover temp folder.
    save_artifact(out, _manifest(modules={}, method="next"), {})
    assert load_artifact(out)[0].method == "next"
