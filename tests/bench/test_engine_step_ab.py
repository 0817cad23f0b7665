"""bench.engine_step: --ab-rounds' alternating order and per-round speed-up (step times stubbed), --region-times' count
of a step's regions, and the flags that shape its runner."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from bench import engine_step
from bench.model_costs import TokenArithmetic
from compression.compress import CompressSettings, compress_model
from server.models import fused_ops
from support import tiny_config_file


def test_rounds_alternate_abba_and_speedups_are_neighbouring_ratios(monkeypatch):
    calls = []
    fake_ms = {"dense": [10.0, 12.0, 11.0, 9.0], "compressed": [8.0, 10.0, 11.0, 6.0]}

    def fake_step_times(runner, batch_size, context, steps, seed, block_size):
        calls.append((runner, seed))
        ms = fake_ms[runner][len([c for c in calls if c[0] == runner]) - 1]
        return [ms / 1000] * steps

    monkeypatch.setattr(engine_step, "step_times", fake_step_times)
    args = argparse.Namespace(batch_sizes=[1], ab_rounds=4, ab_paired=False, context=8, steps=3, seed=0)
    (row,) = engine_step.ab_rows("dense", "compressed", args, block_size=16)
    assert [c[0] for c in calls] == ["dense", "compressed", "compressed", "dense"] * 2  # ABBA: drift cancels
    assert [c[1] for c in calls][::2] == [0, 1, 2, 3]  # each round its own prompts, both sides the same
    assert row["dense_step_ms"] == pytest.approx(fake_ms["dense"])
    assert row["speedup_median"] == pytest.approx((10 / 8 + 12 / 10) / 2)  # ratios 1.0, 1.2, 1.25, 1.5
    assert (row["speedup_min"], row["speedup_max"]) == pytest.approx((1.0, 1.5))


class _Recorder:
    """A runner that records each execute call (its name, the chunks' positions and tokens) and takes no time."""

    vocab_size = 5000

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def execute(self, chunks):
        self.calls.append((self.name, [c.start_pos for c in chunks], [c.token_ids for c in chunks]))

    def release_slot(self, slot):
        pass


def test_paired_steps_alternate_abba_on_the_same_tokens():
    calls = []
    dense, compressed = _Recorder("dense", calls), _Recorder("compressed", calls)
    d, c = engine_step.paired_step_times(dense, compressed, 2, context=8, steps=4, seed=3, block_size=16)
    assert len(d) == len(c) == 4
    steps = calls[4:]  # after each side's two prompts
    assert [s[0] for s in steps] == ["dense", "compressed", "compressed", "dense"] * 2
    assert [s[1] for s in steps] == [[8, 8], [8, 8], [9, 9], [9, 9], [10, 10], [10, 10], [11, 11], [11, 11]]
    assert calls[0][2] == calls[2][2] and steps[0][2] == steps[1][2]  # the same prompts, the same tokens


def test_paired_rounds_take_the_median_of_per_step_ratios(monkeypatch):
    warm = [99.0] * 5  # the first five steps of each side are dropped
    per_step = {0: ([10, 30, 10, 20], [10, 10, 8, 10]),  # ratios 1, 3, 1.25, 2
                1: ([10] * 4, [8] * 4)}

    def fake_paired(first, second, batch_size, context, steps, seed, block_size):
        return tuple([t / 1000 for t in warm + times] for times in per_step[seed])

    monkeypatch.setattr(engine_step, "paired_step_times", fake_paired)
    args = argparse.Namespace(batch_sizes=[16], ab_rounds=2, ab_paired=True, context=8, steps=3, seed=0)
    (row,) = engine_step.ab_rows("dense", "compressed", args, block_size=16)
    # round 0: median of ratios (1, 3, 1.25, 2) = 1.625, not the ratio of the medians (15 / 10); round 1: 1.25
    assert (row["speedup_min"], row["speedup_max"]) == pytest.approx((1.25, 1.625))
    assert row["dense_step_ms"] == pytest.approx([15.0, 10.0]) and row["compressed_step_ms"] == pytest.approx([10.0, 8.0])


def test_ab_paired_needs_rounds(capsys):
    with pytest.raises(SystemExit):
        engine_step.main(["--ab-paired", "--compressed", "x"])
    assert "--ab-paired needs --ab-rounds" in capsys.readouterr().err


def test_ab_needs_an_artifact(capsys):
    with pytest.raises(SystemExit):
        engine_step.main(["--ab-rounds", "2"])
    assert "--ab-rounds needs --compressed" in capsys.readouterr().err


@pytest.mark.parametrize("python_layers", [False, True])
def test_python_layers_turns_the_cpp_layer_loop_off(tiny_model_dir, python_layers):
    model = argparse.Namespace(dtype="float32", quantization=None, source="safetensors")
    cfg = argparse.Namespace(model=model, device="cpu", engine=argparse.Namespace(block_size=16, kv_cache_dtype="auto"))
    args = argparse.Namespace(context=8, steps=4, hold=0, num_threads=None, no_panel_gemm=False, batch_sizes=[1],
                              python_layers=python_layers)
    runner = engine_step._load_runner(tiny_model_dir, cfg, args, None)
    assert runner.model.use_decoder_plan is not python_layers


def test_kv_cache_dtype_overrides_the_configs_and_is_recorded(tiny_model_dir, tmp_path):
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "step.json"
    assert engine_step.main(["--config", str(config), "--kv-cache-dtype", "fp8", "--batch-sizes", "2",
                             "--context", "8", "--steps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == "float8_e4m3fn" and report["rows"][0]["step_ms_p50"] > 0


def test_each_step_states_its_flops_and_their_floor_at_the_measured_peak(tiny_model_dir, tmp_path):
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "step.json"
    assert engine_step.main(["--config", str(config), "--batch-sizes", "1", "3", "--context", "8", "--steps", "4",
                             "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    arithmetic = TokenArithmetic(**report["arithmetic"])
    for row in report["rows"]:  # the median timed step: position 8 + 5 + 2, so 16 positions attended
        assert row["gflop"] == pytest.approx(arithmetic.decode_step_flops(row["batch_size"], 16) / 1e9)
        if report["gemm_peak"] is None:
            assert row["compute_floor_ms"] is None
        else:
            assert row["compute_floor_ms"] == pytest.approx(row["gflop"] / report["gemm_peak"]["gops"] * 1e3)
    assert report["rows"][1]["gflop"] == pytest.approx(3 * report["rows"][0]["gflop"])


class _OneRegionPerStep(_Recorder):
    """A runner whose every call runs one balanced region (neuronmm::balanced_for over 32 items)."""

    def execute(self, chunks):
        super().execute(chunks)
        torch.ops.neuronmm.balanced_for_owners(torch.full((32,), 5, dtype=torch.long), 0)


@pytest.mark.skipif(not fused_ops.load(), reason="no C++ compiler: the fused ops cannot be built")
def test_region_times_count_the_timed_steps_regions_only():
    calls = []
    row = engine_step.region_times(_OneRegionPerStep("model", calls), 2, context=8, steps=9, seed=0, block_size=16)
    assert len(calls) == 2 + 9  # the two prompts, 5 untimed steps and 4 timed ones
    assert row["regions"] == 1  # per timed step: neither the prompts nor the untimed steps are counted
    assert 0 < row["in_regions_ms"] <= row["step_ms"]
    assert row["outside_regions_ms"] == pytest.approx(row["step_ms"] - row["in_regions_ms"])
    assert min(row["fork_ms"], row["tail_ms"], row["join_ms"]) >= 0
    assert row["barrier_ms"] == 0  # its one region a step has a single phase
    assert torch.ops.neuronmm.region_times(False) == [0] * 6  # the clocks were switched off again


def test_region_times_refuse_an_ab_run(tmp_path):
    with pytest.raises(SystemExit):
        engine_step.main(["--region-times", "--compressed", str(tmp_path), "--ab-rounds", "2"])


def test_held_steps_cycle_over_positions_past_the_context():
    calls, ticks = [], iter(range(1000))
    times = engine_step.held_step_times(_Recorder("model", calls), 2, context=8, seconds=70, seed=0, block_size=16,
                                        clock=lambda: next(ticks))  # one tick a clock read: 69 steps in 70 "seconds"
    steps = calls[2:]  # after the two prompts
    assert len(times) == len(steps) == 69
    assert [s[1] for s in steps] == [[8 + i % engine_step.HOLD_CYCLE] * 2 for i in range(69)]  # wraps after 64


def test_hold_runs_the_last_batch_size_and_records_its_steps(tiny_model_dir, tmp_path, capsys):
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "step.json"
    assert engine_step.main(["--config", str(config), "--batch-sizes", "1", "2", "--context", "8", "--steps", "2",
                             "--hold", "0.3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert "held" not in rows[0] and rows[1]["held"]["steps"] > 0 and rows[1]["held"]["step_ms_p50"] > 0
    assert "pid " in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--hold", "-1"], ["--hold", "5", "--compressed", "x", "--ab-rounds", "2"]])
def test_hold_refuses_a_negative_time_or_an_ab_run(flags, capsys):
    with pytest.raises(SystemExit):
        engine_step.main(flags)
    assert "--hold" in capsys.readouterr().err


def test_an_ab_run_states_the_speed_ups_bounds_from_the_two_models_bytes_and_flops(tiny_model_dir, tmp_path, capsys):
    artifact = tmp_path / "art"
    compress_model(tiny_model_dir, CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32,
                                                    batch_size=2, allocation="uniform"), artifact, model_id="tiny")
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "ab.json"
    assert engine_step.main(["--config", str(config), "--compressed", str(artifact), "--ab-rounds", "2",
                             "--batch-sizes", "1", "4", "--context", "8", "--steps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    dense, compressed = (TokenArithmetic(**report["arithmetic"][side]) for side in ("dense", "compressed"))
    assert compressed.decode_macs < dense.decode_macs  # keep 0.5 of the MLP
    context = engine_step.median_context(SimpleNamespace(context=8, steps=2))  # the positions the median step attends
    for row in report["rows"]:
        want = (dense.decode_step_flops(row["batch_size"], context) /
                compressed.decode_step_flops(row["batch_size"], context))
        assert row["flops_ratio"] == pytest.approx(want) and row["flops_ratio"] > 1
    weights = report["weight_bytes"]
    assert weights["dense"] > weights["compressed"]
    for row in report["rows"]:  # the KV cache both read dilutes the weights' ratio, more at the larger batch
        assert row["kv_bytes"] == row["batch_size"] * context * report["kv_bytes_per_position"] > 0
        assert row["bytes_ratio"] == pytest.approx((weights["dense"] + row["kv_bytes"]) /
                                                   (weights["compressed"] + row["kv_bytes"]))
    one, four = report["rows"]
    assert weights["dense"] / weights["compressed"] > one["bytes_ratio"] > four["bytes_ratio"] > 1
    assert "the speed-up's bounds" in capsys.readouterr().out
