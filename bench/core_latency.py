"""Core-to-core round trip: whether this machine's first two CPUs share a last-level cache right now.

A cloud VM's vCPUs are placed on physical cores by its host, and the placement changes while it runs. On the 2-vCPU
AMD EPYC VMs this project measures on, two vCPUs on one core complex pass a cache line back and forth in ~65 ns;
placed on two (each with its own L3) it takes ~350 ns, and a batch-16 decode step, whose two threads hand every
activation to each other, runs 1-2 ms slower while a batch-1 step (which streams weights, from twice the L3) runs
faster (docs/BENCHMARKS.md, "Where the vCPUs sit"). A report that records this next to its times says which of
those machines it measured. Measured by two threads pinned to CPUs 0 and 1 bouncing a counter through one cache
line; the C source is compiled once with the system compiler (None where there is none, or under two CPUs).

    python -m bench.core_latency
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static _Atomic long line __attribute__((aligned(64)));
static long rounds;

static int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *answer(void *cpu) {
  if (pin(*(int *)cpu) != 0) return (void *)1;
  for (long i = 0; i < rounds; ++i) {
    while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
  }
  return 0;
}

/* Mean ns of a round trip between CPUs a and b over n rounds; -1 where a thread cannot be pinned. The caller's
   thread keeps its affinity: it is restored before returning. */
double round_trip_ns(int a, int b, long n) {
  cpu_set_t before;
  pthread_getaffinity_np(pthread_self(), sizeof before, &before);
  if (pin(a) != 0) return -1;
  rounds = n;
  atomic_store(&line, 0);
  pthread_t other;
  if (pthread_create(&other, 0, answer, &b) != 0) return -1;
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0; i < n; ++i) {
    atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2) {}
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  void *failed;
  pthread_join(other, &failed);
  pthread_setaffinity_np(pthread_self(), sizeof before, &before);
  if (failed) return -1;
  return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / n;
}
"""


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled probe (cached by its source's hash), or None without a C compiler."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"neuronmm-core-latency-{digest}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            source, built = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
            source.write_text(_SOURCE)
            done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o", str(built)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("core latency probe not built: %s", done.stderr.strip()[-300:])
                return None
            os.replace(built, target)  # whole or absent: another process may build it at the same time
    library = ctypes.CDLL(str(target))
    library.round_trip_ns.restype = ctypes.c_double
    library.round_trip_ns.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return library


def core_round_trip_ns(rounds: int = 100_000) -> float | None:
    """Mean ns for a cache line to go from CPU 0 to CPU 1 and back (the better of two runs of `rounds`), or None
    where it cannot be measured (one CPU, no compiler, pinning refused)."""
    if (os.cpu_count() or 1) < 2:
        return None
    library = _library()
    if library is None:
        return None
    runs = [library.round_trip_ns(0, 1, rounds) for _ in range(2)]
    return None if min(runs) < 0 else round(min(runs), 1)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print the round trip between CPUs 0 and 1 (or why it cannot be measured)."""
    p = argparse.ArgumentParser(prog="bench.core_latency", description=__doc__.splitlines()[0])
    p.parse_args(argv)
    ns = core_round_trip_ns()
    print("core 0 <-> core 1 round trip: " + ("not measurable here (one CPU, no C compiler, or pinning refused)"
                                              if ns is None else f"{ns} ns"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
