"""bench.serve pairs each served neuronmm model with its engine-only twin (run right after it)."""

from __future__ import annotations

from bench.serve import workload_args


def test_each_served_model_has_its_engine_only_twin():
    assert workload_args("neuronmm", None) == []
    assert workload_args("neuronmm compressed", "/a") == ["--compressed", "/a"]
    assert workload_args("neuronmm fp32", None) == ["--dtype", "float32"]


def test_sampled_and_peer_systems_have_none():
    assert workload_args("neuronmm sampled", None) is None  # the same model as "neuronmm"
    assert workload_args("llama-server bf16", None) is None
    assert workload_args("neuronmm compressed", None) is None  # no artifact given
