"""bench.stream_cpu: per-token CPU of the API process, the engine core and the client over rounds of one stream,
saved with the machine's facts; bad arguments stop with a usage error and write nothing."""

from __future__ import annotations

import json

import pytest

from bench import stream_cpu
from bench.harness import write_config


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_rounds_are_measured_and_saved(tiny_model_dir, tmp_path, capsys, route):
    config = write_config(tmp_path / "serve.yaml", tiny_model_dir, engine={"max_model_len": 256})
    out = tmp_path / "cpu.json"
    assert stream_cpu.main(["--config", str(config), "--route", route, "--tokens", "24", "--rounds", "2",
                            "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["chunks"] for r in report["rounds"]] == [24, 24]  # one chunk a token (a chat's first: its role too)
    for name in ("api", "engine_core", "client"):
        figures = report["summary"][f"{name}_ms"]
        assert 0 < figures["min"] <= figures["median"] <= figures["max"]
    assert report["route"] == route and isinstance(report["cpu_flags"], list)
    assert "| API process CPU |" in capsys.readouterr().out


def test_bad_arguments_are_usage_errors(tmp_path):
    out = tmp_path / "cpu.json"
    for args in (["--tokens", "0"], ["--config", str(tmp_path / "missing.yaml")]):
        with pytest.raises(SystemExit) as stop:
            stream_cpu.main([*args, "--out", str(out)])
        assert stop.value.code == 2 and not out.exists()
