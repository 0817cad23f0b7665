"""bench.core_latency: the core-to-core round trip a report records beside its times."""

from __future__ import annotations

import os
import shutil

import pytest

from bench.core_latency import core_round_trip_ns


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="needs two CPUs and a C compiler")
def test_round_trip_is_measured_and_leaves_the_callers_affinity_alone():
    """A round trip between CPUs 0 and 1 takes tens to hundreds of ns; the caller's thread, pinned to CPU 0 while
    it ran, gets its own CPU set back (a benchmark's torch threads must not stay on one core)."""
    before = os.sched_getaffinity(0)
    if not {0, 1} <= before:
        pytest.skip("this process may not run on CPUs 0 and 1")
    trip = core_round_trip_ns(rounds=20_000)
    assert trip is not None and 5 < trip < 100_000
    assert os.sched_getaffinity(0) == before
