"""ServerMetrics: a step's observations are kept until the metrics are read, and never lost or held unbounded."""

from __future__ import annotations

from server.api.metrics import ServerMetrics
from server.engine.step_stats import KVStats, StepStats


def _generated(metrics: ServerMetrics) -> float:
    """Tokens the counter holds now (read without render, which applies the kept steps first)."""
    return metrics.registry.get_sample_value("neuronmm_generation_tokens_total", {"model_name": "m"})


def test_kept_steps_show_in_the_rendered_metrics():
    metrics = ServerMetrics("m")
    for i in range(10):
        metrics.observe_step(StepStats(2, 0, 2, itls=[0.01, 0.02], kv=KVStats(64, i)))
    assert _generated(metrics) == 0  # kept, not applied
    text = metrics.render().decode()
    assert 'neuronmm_generation_tokens_total{model_name="m"} 20.0' in text
    assert 'vllm:generation_tokens_total{model_name="m"} 20.0' in text
    assert 'neuronmm_inter_token_latency_seconds_count{model_name="m"} 20.0' in text
    assert 'neuronmm_kv_cache_usage_perc{model_name="m"}' in text and metrics.kv == KVStats(64, 9)  # the latest


def test_a_server_nobody_scrapes_applies_its_steps_as_they_pile_up():
    metrics = ServerMetrics("m")
    for _ in range(1000):
        metrics.observe_step(StepStats(1, 0, 1))
    assert 1000 - 256 < _generated(metrics) <= 1000
    assert 'neuronmm_generation_tokens_total{model_name="m"} 1000.0' in metrics.render().decode()
