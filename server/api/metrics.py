"""Prometheus metrics of the server (one registry per app, so several apps can live in one process)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from server.engine.llm_engine import StepStats

# Backends with static-shape buckets (neuron) register their PaddingStats here at load; weak, so a
# finished runner disappears from /metrics with it.
_PADDING_SOURCES: "weakref.WeakSet" = weakref.WeakSet()


def register_padding_source(stats) -> None:
    """Expose a backend's per-bucket padding counts (an object with `snapshot()`) on /metrics."""
    _PADDING_SOURCES.add(stats)


class _PaddingCollector:
    """neuronmm_bucket_{real,padding}_slots{phase,bucket}: padding waste per compiled bucket."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def collect(self):
        labels = ["model_name", "phase", "bucket"]
        real = CounterMetricFamily("neuronmm_bucket_real_slots", "Useful slots (tokens or sequences) run per "
                                   "compiled bucket", labels=labels)
        pad = CounterMetricFamily("neuronmm_bucket_padding_slots", "Padded (wasted) slots run per compiled bucket",
                                  labels=labels)
        for source in list(_PADDING_SOURCES):
            for (phase, bucket), c in sorted(source.snapshot().items()):
                key = [self.model_name, phase, str(bucket)]
                real.add_metric(key, c["real"])
                pad.add_metric(key, c["padding"])
        yield real
        yield pad


_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """TTFT / inter-token / e2e histograms, running and waiting gauges, token and request counters."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        reg = self.registry

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg).labels(**labels)

        self.ttft = hist("neuronmm_time_to_first_token_seconds", "Time from arrival to first token")
        self.itl = hist("neuronmm_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("neuronmm_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.batch_size = hist("neuronmm_batch_size", "Sequences in one engine forward",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.running = Gauge("neuronmm_num_requests_running", "Sequences in the running batch",
                             ["model_name"], registry=reg).labels(**labels)
        self.waiting = Gauge("neuronmm_num_requests_waiting", "Sequences waiting for a slot",
                             ["model_name"], registry=reg).labels(**labels)
        self.prompt_tokens = Counter("neuronmm_prompt_tokens", "Prefill tokens computed",
                                     ["model_name"], registry=reg).labels(**labels)
        self.generation_tokens = Counter("neuronmm_generation_tokens", "Tokens generated",
                                         ["model_name"], registry=reg).labels(**labels)
        self._requests = Counter("neuronmm_request_success", "Finished sequences by finish reason",
                                 ["model_name", "finished_reason"], registry=reg)
        self._model_name = model_name
        reg.register(_PaddingCollector(model_name))

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def observe_step(self, stats: StepStats) -> None:
        """Engine hook (its thread, or the reader of the engine process): one forward's tokens and latencies."""
        self.batch_size.observe(stats.batch_size)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.ttfts:
            self.ttft.observe(ttft)
        for itl in stats.itls:
            self.itl.observe(itl)
        for reason, e2e in stats.finished:
            self.finished(reason, e2e)

    def finished(self, reason: str, e2e_s: float | None = None) -> None:
        self._requests.labels(model_name=self._model_name, finished_reason=reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
