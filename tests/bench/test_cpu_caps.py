"""bench.cpu_caps: a capped command sees every library's cap; a bad cap is a one-line usage error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.cpu_caps import CAP_VARIABLES, CAPS, caps_in_force

SHOW_ENV = "import json, os; print(json.dumps({k: os.environ.get(k) for k in %r}))"


@pytest.mark.parametrize("cap", sorted(CAPS))
def test_a_capped_command_sees_every_cap(cap):
    names = sorted(CAPS[cap])
    out = subprocess.run([sys.executable, "-m", "bench.cpu_caps", cap, sys.executable, "-c", SHOW_ENV % names],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == CAPS[cap]


def test_the_caps_reach_every_library_that_would_run_a_newer_path():
    assert CAPS["avx2"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"  # torch's fp32 matmul goes through MKL
    assert CAPS["avx512-bf16"]["NEURONMM_BF16_AMX_ROWS"] == "0"  # our bf16 GEMMs' AMX path (gemm_tuning)


def test_an_unknown_cap_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "bench.cpu_caps", "avx9", "true"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "usage" in run.stderr


def test_caps_in_force_reads_the_environment(monkeypatch):
    for name in CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert caps_in_force() == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert caps_in_force() == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
