"""bench.engine_workload: a level's decode steps and its requests' TPOT, as bench.serve's client would time them."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from bench import engine_workload
from bench.engine_workload import measure_level, run_level
from bench.harness import level_size
from bench.model_costs import TokenArithmetic, level_kv_bytes, min_level_steps
from server.models import fused_ops
from support import tiny_config_file
from transformers import AutoConfig


class FakeEngine:
    """Takes one new prompt per step (its first token costs 30 ms of the step), decodes the others (10 ms); advances
    the clock it is given instead of running anything."""

    def __init__(self, now: list[float]):
        self.now, self.waiting, self.running = now, [], {}
        self.prompts, self.waiting_at_step = [], []  # every prompt added; how many waited as each step began

    def add_request(self, request_id, prompt, params) -> None:
        self.waiting.append((request_id, params.max_tokens))
        self.prompts.append(prompt)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        self.waiting_at_step.append(len(self.waiting))
        outputs = []
        for rid, (made, wanted) in list(self.running.items()):
            self.running[rid] = (made + 1, wanted)
        if self.waiting:
            rid, wanted = self.waiting.pop(0)
            self.running[rid] = (1, wanted)
        self.now[0] += 0.030 if any(made == 1 for made, _ in self.running.values()) else 0.010
        for rid, (made, wanted) in list(self.running.items()):
            done = made == wanted
            outputs.append(SimpleNamespace(request_id=rid, token_ids=[7], num_output_tokens=made,
                                           finish_reason="length" if done else None))
            if done:
                del self.running[rid]
        return outputs


def test_tpot_counts_the_steps_that_carry_other_prompts_and_the_decode_step_does_not():
    now = [0.0]
    row = run_level(FakeEngine(now), [[1], [2], [3]], concurrency=2, output_len=4, sampled=False,
                    clock=lambda: now[0])
    # A: tokens at 30, 60 (B's prompt rides along), 70, 80 ms; B: 60, 70, 80, 110 (C's prompt); C: 110, 120, 130, 140
    assert row["tpot_ms_p50"] == pytest.approx(50 / 3)
    assert row["decode_step_ms_p50"] == pytest.approx(10.0)
    assert (row["output_tokens"], row["num_decode_steps"], row["num_other_steps"]) == (12, 5, 3)
    assert row["duration_s"] == pytest.approx(0.140)


def test_the_first_step_of_a_level_starts_with_one_request_as_served_then_the_level_keeps_its_concurrency():
    now = [0.0]
    engine = FakeEngine(now)
    run_level(engine, [[1], [2], [3], [4], [5]], concurrency=3, output_len=4, sampled=False, clock=lambda: now[0])
    # step 1: the first request alone; step 2: the other two of the wave (the fake takes one a step, so one waits on)
    assert engine.waiting_at_step[:3] == [1, 2, 1]
    assert len(engine.prompts) == 5


def test_a_measured_level_never_reuses_its_warm_up_prompts():
    engine = FakeEngine([0.0])
    row = measure_level(engine, random.Random(0), vocab=50_000, concurrency=3, input_len=16, output_len=4, sampled=False)
    warm, level = engine.prompts[:3], engine.prompts[3:]
    assert len(level) == level_size(3) == row["num_prompts"]
    assert not {tuple(p) for p in warm} & {tuple(p) for p in level}  # a prefix cache could not serve the level


def test_each_level_states_its_flops_and_the_ceiling_they_allow_at_the_measured_peak(tiny_model_dir, tmp_path, capsys):
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "workload.json"
    assert engine_workload.main(["--config", str(config), "--dtype", "float32", "--concurrency", "2",
                                 "--input-len", "8", "--output-len", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    arithmetic = TokenArithmetic(**report["arithmetic"])
    assert row["gflop"] == pytest.approx(arithmetic.level_flops([8] * row["num_prompts"], 4) / 1e9)
    peak = report["gemm_peak"]
    if fused_ops.load():  # an fp32 model: its GEMMs run on fp32 FMAs, whose peak the probe measured
        steps = min_level_steps(row["num_prompts"], 2, 4)
        config = AutoConfig.from_pretrained(tiny_model_dir)  # an fp32 cache: K and V of every layer, 4 bytes a value
        head_dim = config.hidden_size // config.num_attention_heads
        per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
        assert row["kv_bytes"] == level_kv_bytes([8] * row["num_prompts"], 4, per_position) > 0
        stream_s = (steps * report["weight_bytes"] + row["kv_bytes"]) / (report["memory_bandwidth_gbs"] * 1e9)
        assert peak["kind"] == "fp32_fma" and row["ceiling_tok_s"] == pytest.approx(
            row["output_tokens"] / max(row["gflop"] / peak["gops"], stream_s))
        assert row["weight_bytes"] == report["weight_bytes"] > 0
        assert "ceiling: the level's FLOPs" in capsys.readouterr().out
    else:
        assert peak is None and row["ceiling_tok_s"] is None
