"""bench.harness.tree_rss_mb counts a server's child processes (the engine core runs in one), not the parent alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil

from bench.harness import tree_rss_mb

# A parent that starts a child holding 200 MB of written memory, says so, and waits to be killed.
_PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c",
        "import sys; block = b'x' * (200 * 2**20); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(child.stdout.readline().strip(), flush=True)
    sys.stdin.read()
""")


def test_tree_rss_counts_children():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        own = psutil.Process(parent.pid).memory_info().rss / 2**20
        assert tree_rss_mb(parent.pid) - own >= 190  # the child's 200 MB, every page written
    finally:
        parent.kill()  # the child reads EOF on its stdin (the parent's end closes) and exits
        parent.wait()
