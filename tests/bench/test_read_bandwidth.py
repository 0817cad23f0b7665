"""bench.read_bandwidth: one row per working-set size with both readers, saved with the CPU flags; the floor is the
faster reader; bad sizes stop with a usage error, bad buffers with the op's."""

from __future__ import annotations

import json

import pytest
import torch

from bench import read_bandwidth
from server.models import fused_ops

needs_ops = pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")


def test_rows_per_size_are_saved(tmp_path, capsys):
    out = tmp_path / "bw.json"
    assert read_bandwidth.main(["--sizes-mb", "1", "2", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["mb"] for row in report["rows"]] == [1, 2]
    assert all(row["gbs"] > 0 for row in report["rows"]) and isinstance(report["cpu_flags"], list)
    assert "| 2 |" in capsys.readouterr().out


def test_a_non_positive_size_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as stop:
        read_bandwidth.main(["--sizes-mb", "0", "--out", str(tmp_path / "bw.json")])
    assert stop.value.code == 2 and not (tmp_path / "bw.json").exists()


def test_each_row_has_both_readers_and_the_floor_is_the_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(read_bandwidth, "summed_gbs", lambda nbytes, repeats=5: 20.0)
    monkeypatch.setattr(read_bandwidth, "streamed_gbs", lambda nbytes, repeats=5: 30.0)
    assert read_bandwidth.read_bandwidth_gbs(2**20) == 30.0
    out = tmp_path / "bw.json"
    assert read_bandwidth.main(["--sizes-mb", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == [{"mb": 1, "summed_gbs": 20.0, "streamed_gbs": 30.0, "gbs": 30.0}]
    monkeypatch.setattr(read_bandwidth, "streamed_gbs", lambda nbytes, repeats=5: None)  # no fused ops: the sum
    assert read_bandwidth.read_bandwidth_gbs(2**20) == 20.0


@needs_ops
def test_the_streamed_read_runs_and_refuses_what_it_cannot_read():
    assert read_bandwidth.streamed_gbs(2**20, repeats=2) > 0
    op = torch.ops.neuronmm.stream_read_rate
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        op(torch.ones(64, 64, dtype=torch.uint8).t(), 1)
    with pytest.raises(RuntimeError, match="repeats must be positive"):
        op(torch.ones(2**16, dtype=torch.uint8), 0)
    with pytest.raises(RuntimeError, match="two 64-byte lines per thread"):
        op(torch.ones(64 * torch.get_num_threads(), dtype=torch.uint8), 1)  # a line a thread: too little
