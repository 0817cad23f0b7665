"""bench.engine_workload: a level's decode steps and its requests' TPOT, as bench.serve's client would time them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.engine_workload import run_level


class FakeEngine:
    """Takes one new prompt per step (its first token costs 30 ms of the step), decodes the others (10 ms); advances
    the clock it is given instead of running anything."""

    def __init__(self, now: list[float]):
        self.now, self.waiting, self.running = now, [], {}

    def add_request(self, request_id, prompt, params) -> None:
        self.waiting.append((request_id, params.max_tokens))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
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
