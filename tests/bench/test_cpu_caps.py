"""bench.cpu_caps: a capped command sees every library's cap; a bad cap is a one-line usage error."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.cpu_caps import CAPS, caps_in_force

SHOW_ENV = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))"


def test_a_capped_command_sees_every_cap():
    names = sorted(CAPS["avx2"])
    out = subprocess.run([sys.executable, "-m", "bench.cpu_caps", "avx2", sys.executable, "-c", SHOW_ENV % names],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == CAPS["avx2"]
    assert CAPS["avx2"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"  # torch's fp32 matmul goes through MKL


def test_an_unknown_cap_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "bench.cpu_caps", "avx9", "true"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "usage" in run.stderr


def test_caps_in_force_reads_the_environment(monkeypatch):
    for name in CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    assert caps_in_force() == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert caps_in_force() == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
