"""bench.engine_step: --ab-rounds' alternating order and per-round speed-up (step times stubbed), and the flags that shape its runner."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from bench import engine_step
from support import tiny_config


def test_rounds_alternate_abba_and_speedups_are_neighbouring_ratios(monkeypatch):
    calls = []
    fake_ms = {"dense": [10.0, 12.0, 11.0, 9.0], "compressed": [8.0, 10.0, 11.0, 6.0]}

    def fake_step_times(runner, batch_size, context, steps, seed, block_size):
        calls.append((runner, seed))
        ms = fake_ms[runner][len([c for c in calls if c[0] == runner]) - 1]
        return [ms / 1000] * steps

    monkeypatch.setattr(engine_step, "step_times", fake_step_times)
    args = argparse.Namespace(batch_sizes=[1], ab_rounds=4, context=8, steps=3, seed=0)
    (row,) = engine_step.ab_rows("dense", "compressed", args, block_size=16)
    assert [c[0] for c in calls] == ["dense", "compressed", "compressed", "dense"] * 2  # ABBA: drift cancels
    assert [c[1] for c in calls][::2] == [0, 1, 2, 3]  # each round its own prompts, both sides the same
    assert row["dense_step_ms"] == pytest.approx(fake_ms["dense"])
    assert row["speedup_median"] == pytest.approx((10 / 8 + 12 / 10) / 2)  # ratios 1.0, 1.2, 1.25, 1.5
    assert (row["speedup_min"], row["speedup_max"]) == pytest.approx((1.0, 1.5))


def test_ab_needs_an_artifact(capsys):
    with pytest.raises(SystemExit):
        engine_step.main(["--ab-rounds", "2"])
    assert "--ab-rounds needs --compressed" in capsys.readouterr().err


@pytest.mark.parametrize("python_layers", [False, True])
def test_python_layers_turns_the_cpp_layer_loop_off(tiny_model_dir, python_layers):
    cfg = argparse.Namespace(model=argparse.Namespace(dtype="float32"), device="cpu",
                             engine=argparse.Namespace(block_size=16, kv_cache_dtype="auto"))
    args = argparse.Namespace(context=8, steps=4, num_threads=None, no_panel_gemm=False, batch_sizes=[1],
                              python_layers=python_layers)
    runner = engine_step._load_runner(tiny_model_dir, cfg, args, None)
    assert runner.model.use_decoder_plan is not python_layers


def test_kv_cache_dtype_overrides_the_configs_and_is_recorded(tiny_model_dir, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tiny_model_dir).model_dump(mode="json")))
    out = tmp_path / "step.json"
    assert engine_step.main(["--config", str(config), "--kv-cache-dtype", "fp8", "--batch-sizes", "2",
                             "--context", "8", "--steps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == "float8_e4m3fn" and report["rows"][0]["step_ms_p50"] > 0
