"""bench.cpu_caps: a capped command sees every library's cap; a bad cap is a one-line usage error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from bench.cpu_caps import CAP_VARIABLES, CAPS, caps_in_force
from server.models.cpu_features import ARCH_ENV, target_has_native_bf16

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


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to read what a -march enables")
@pytest.mark.parametrize("cap", ["avx2", "avx512"])
def test_the_classes_without_native_bf16_build_for_a_target_without_it(cap, monkeypatch):
    # dtype: auto then serves fp32 under the cap, as it would on such a CPU
    monkeypatch.setenv(ARCH_ENV, CAPS[cap]["NEURONMM_CPU_ARCH"])
    assert not target_has_native_bf16()
    monkeypatch.setenv(ARCH_ENV, "sapphirerapids")  # the check itself can say yes
    assert target_has_native_bf16()


def test_an_unknown_cap_is_a_usage_error():
    run = subprocess.run([sys.executable, "-m", "bench.cpu_caps", "avx9", "true"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "usage" in run.stderr


def test_caps_in_force_reads_the_environment(monkeypatch):
    for name in CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert caps_in_force() == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert caps_in_force() == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
