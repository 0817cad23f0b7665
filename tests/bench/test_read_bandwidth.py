"""bench.read_bandwidth: one row per working-set size, saved with the CPU flags; bad sizes stop with a usage error."""

from __future__ import annotations

import json

import pytest

from bench import read_bandwidth


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
