"""The KV pool is checked against the memory available before it is made: a pool backed in the background must fail
at start-up, not under load."""

from __future__ import annotations

import types

import pytest
import torch

from server import runtime
from server.config import ConfigError, EngineConfig


def test_memory_available_takes_the_cgroup_limit_when_it_is_lower(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("3221225472\n")  # 3 GiB, 1 GiB of it in use
    (tmp_path / "memory.current").write_text(str(2**30))
    monkeypatch.setattr(runtime, "CGROUP_ROOT", tmp_path)
    assert runtime.memory_available() == 2 * 2**30  # under any machine's MemAvailable in CI


def test_memory_available_ignores_a_cgroup_without_a_limit(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123")
    monkeypatch.setattr(runtime, "CGROUP_ROOT", tmp_path)
    found = runtime.memory_available()
    assert found is None or found > 2**20  # MemAvailable alone (None where /proc/meminfo is absent)


class _PagedRunner:
    supports_paged_kv = True
    device = torch.device("cpu")

    def __init__(self):
        self.allocated = None

    def kv_bytes_per_token(self) -> int:
        return 1024

    def allocate_kv_blocks(self, num_blocks: int, block_size: int) -> None:
        self.allocated = (num_blocks, block_size)


def _cfg(**engine) -> types.SimpleNamespace:
    return types.SimpleNamespace(engine=EngineConfig(**{"max_num_seqs": 4, "max_model_len": 256, "block_size": 16,
                                                        **engine}))


def test_a_pool_larger_than_the_memory_available_is_refused_before_it_is_made(monkeypatch):
    monkeypatch.setattr(runtime, "memory_available", lambda: 2**20)  # 1 MiB: 4 sequences of 256 tokens of 1 KiB
    runner = _PagedRunner()
    with pytest.raises(ConfigError, match="does not fit the 0.00 GiB of memory available"):
        runtime.allocate_kv(_cfg(max_num_seqs=5), runner)
    assert runner.allocated is None
    kv = runtime.allocate_kv(_cfg(), runner)  # exactly 1 MiB fits
    assert runner.allocated == (64, 16) and kv.capacity == 64


def test_no_check_where_the_memory_cannot_be_read_or_the_pool_is_not_on_the_cpu(monkeypatch):
    monkeypatch.setattr(runtime, "memory_available", lambda: None)
    runner = _PagedRunner()
    runtime.allocate_kv(_cfg(), runner)
    assert runner.allocated == (64, 16)
    monkeypatch.setattr(runtime, "memory_available", lambda: 0)
    runner.device = torch.device("cuda")  # a GPU pool: its memory is the device's
    runtime.allocate_kv(_cfg(), runner)
