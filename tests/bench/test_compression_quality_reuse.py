"""bench.compression_quality: which compressions it reuses, and the allocation it asks `neuronmm compress` for."""

from __future__ import annotations

import pytest
import torch

from bench import compression_quality
from compression.rank import block_rank
from server.models.artifact import FORMAT_VERSION, Manifest, ModuleRecord, save_artifact

SHAPES = {"model.layers.0.mlp.gate_proj": (576, 1536), "model.layers.0.mlp.down_proj": (1536, 576)}


def _uniform_artifact(work, label: str, keep: float, multiple: int) -> None:
    modules, tensors = {}, {}
    for name, (in_f, out_f) in SHAPES.items():
        rank = block_rank(in_f, out_f, keep, multiple)
        modules[name] = ModuleRecord(rank=rank, **{"in": in_f, "out": out_f})
        tensors[f"{name}.A"], tensors[f"{name}.B"] = torch.zeros(rank, in_f), torch.zeros(out_f, rank)
    save_artifact(work / label, Manifest(format_version=FORMAT_VERSION, modules=modules), tensors)


def test_a_uniform_twin_is_reused_only_for_a_uniform_allocation(tmp_path):
    _uniform_artifact(tmp_path, "whitened-k0.9-m128", 0.9, 128)
    # keep 0.8 rounds to the same ranks as keep 0.9 at multiple 128: the same factors under uniform allocation
    twin = compression_quality._same_rank_artifact(tmp_path, "whitened", 0.8, 128, "uniform")
    assert twin == tmp_path / "whitened-k0.9-m128"
    assert compression_quality._same_rank_artifact(tmp_path, "plain", 0.8, 128, "uniform") is None
    assert compression_quality._same_rank_artifact(tmp_path, "whitened", 0.6, 128, "uniform") is None
    # the sensitivity allocation's ranks are not known before compressing, so nothing stands in for them
    assert compression_quality._same_rank_artifact(tmp_path, "whitened", 0.8, 128, "sensitivity") is None


class _Compressed(Exception):
    """Raised in place of running `neuronmm compress`, carrying its command."""


@pytest.mark.parametrize("allocation", ["uniform", "sensitivity"])
def test_every_compression_asks_for_the_benchmarks_allocation(allocation, tmp_path, monkeypatch):
    def run_logged(cmd, _log):
        raise _Compressed(cmd)

    monkeypatch.setattr(compression_quality, "_evaluate", lambda *_args: {"label": "dense"})
    monkeypatch.setattr(compression_quality, "run_logged", run_logged)
    argv = ["--keeps", "0.8", "--methods", "whitened", "--multiples", "128", "--allocation", allocation,
            "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "cq.json")]
    with pytest.raises(_Compressed) as compressed:
        compression_quality.main(argv)
    cmd = compressed.value.args[0]
    assert cmd[cmd.index("--allocation") + 1] == allocation
    label = "whitened-k0.8-m128" + ("" if allocation == "uniform" else "-sensitivity")
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "work" / label)
