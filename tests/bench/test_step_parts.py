"""bench.step_parts: clocks on an engine step's parts, put back after, and what their medians leave as glue."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch

from bench import engine_workload
from bench.step_parts import medians_ms, part_clocks, table
from server.engine import llm_engine
from server.models import fused_ops
from support import tiny_config_file


@dataclasses.dataclass(frozen=True)
class Kernels:  # frozen, as the model's own Kernels
    decode_layers: Callable


class Head(torch.nn.Module):
    def forward(self, h):
        return h


class Model:
    def __init__(self):
        self.kernels, self.lm_head = Kernels(lambda x: x), Head()


class Runner:
    def __init__(self):
        self.model = Model()

    def execute(self, chunks):
        return self.model.lm_head(self.model.kernels.decode_layers(torch.zeros(1, 4)))


class Scheduler:
    def schedule(self):
        return [1]


class Engine:
    """An engine step's shape: schedule, execute (layers, then the LM head), sample."""

    def __init__(self):
        self.runner, self.scheduler = Runner(), Scheduler()

    def step(self):
        self.scheduler.schedule()
        return llm_engine.sample(self.runner.execute([]), [])


def test_every_part_is_clocked_once_a_step_and_put_back_after_even_on_error():
    engine = Engine()
    model, kernels, sample = engine.runner.model, engine.runner.model.kernels, llm_engine.sample
    with pytest.raises(RuntimeError):
        with part_clocks(engine) as times:
            for _ in range(3):
                engine.step()
            raise RuntimeError("a level that fails")
    assert {part: len(calls) for part, calls in times.items()} == {
        "step": 3, "execute": 3, "schedule": 3, "lm_head": 3, "layers": 3, "sample": 3}
    assert all(t >= 0 for calls in times.values() for t in calls)
    for owner, name in ((engine, "step"), (engine.runner, "execute"), (engine.scheduler, "schedule"),
                        (model.lm_head, "forward")):
        assert name not in vars(owner), name  # the class's method again
    assert model.kernels is kernels and llm_engine.sample is sample


def test_the_glue_is_what_the_clocked_parts_leave_of_the_step():
    ms = lambda *values: [int(v * 1e6) for v in values]  # noqa: E731
    times = {"step": ms(10, 12, 11), "execute": ms(9, 11, 10), "layers": ms(7, 8, 7.5), "lm_head": ms(1, 1, 1),
             "schedule": ms(0.1, 0.1, 0.1), "sample": ms(0.2, 0.2, 0.2)}
    m = medians_ms(times)
    assert m["rest_of_forward"] == pytest.approx(10 - 7.5 - 1)
    assert m["around_execute"] == pytest.approx(11 - 10)
    assert m["glue_share"] == pytest.approx((1.5 + 1) / 11)
    # a model without the C++ layer loop: its layers are Python glue too, so no share is claimed
    m = medians_ms({part: calls for part, calls in times.items() if part != "layers"})
    assert m["layers"] is None and m["rest_of_forward"] is None and m["glue_share"] is None
    assert "| 16 | 11.00 | – |" in table([{"concurrency": 16, "step_parts_ms": m}])


def test_engine_workload_prints_each_levels_parts(tiny_model_dir, tmp_path, capsys):
    config = tiny_config_file(tiny_model_dir, tmp_path)
    out = tmp_path / "workload.json"
    assert engine_workload.main(["--config", str(config), "--dtype", "float32", "--concurrency", "2",
                                 "--input-len", "8", "--output-len", "4", "--step-parts", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    parts = row["step_parts_ms"]
    assert parts["step"] >= parts["execute"] > parts["lm_head"] > 0 and parts["sample"] > 0
    if fused_ops.load():  # the decoder plan runs the layers in one C++ call
        assert 0 < parts["layers"] < parts["execute"] and 0 < parts["glue_share"] < 1
    assert "| c | step ms | layers (C++) |" in capsys.readouterr().out
