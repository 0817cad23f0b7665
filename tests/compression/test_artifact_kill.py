"""A compression process killed (SIGKILL) in the middle of writing leaves the old artifact whole."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from compression.artifacts import MANIFEST, load_artifact, write_artifact

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import sys, time, torch
    import compression.artifacts as art
    real = art.save_file
    def slow(tensors, path, metadata=None):
        real(tensors, path, metadata=metadata)
        with open(path, "r+b") as fh:
            fh.truncate(100)  # a half-written factors file
        open(sys.argv[2], "w").close()  # tell the parent we are mid-write
        time.sleep(60)
    art.save_file = slow
    art.write_artifact(sys.argv[1], {"format_version": 1, "modules": {}, "method": "new"},
                       {"m.A": torch.ones(2, 3)})
""")


def test_sigkill_mid_write_leaves_old_artifact(tmp_path):
    out = tmp_path / "art"
    write_artifact(out, {"format_version": 1, "modules": {}, "method": "old"}, {})
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
    assert manifest["method"] == "old" and tensors == {}
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "factors.safetensors"])
    # The next write replaces it cleanly despite the dead writer's leftover temp folder.
    write_artifact(out, {"format_version": 1, "modules": {}, "method": "next"}, {})
    assert load_artifact(out)[0]["method"] == "next"
