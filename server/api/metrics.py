"""Prometheus metrics of the server (one registry per app, so several apps can live in one process).

Every serving metric is also exported under vLLM's name (`vllm:time_to_first_token_seconds`, ...), so
vLLM's Grafana dashboards work unchanged; HTTP requests by status and the process's CPU / memory /
file descriptors sit beside them, as prometheus-fastapi-instrumentator and prometheus_client export
them for vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.engine.step_stats import KVStats, LoraStats, StepStats


class _PaddingCollector:
    """neuronmm_bucket_{real,padding}_slots{phase,bucket}: padding waste per compiled bucket (static-shape
    backends report their totals with each step, so this works with the engine in another process)."""

    def __init__(self, model_name: str, metrics: "ServerMetrics"):
        self.model_name = model_name
        self.metrics = metrics

    def collect(self):
        labels = ["model_name", "phase", "bucket"]
        real = CounterMetricFamily("neuronmm_bucket_real_slots", "Useful slots (tokens or sequences) run per "
                                   "compiled bucket", labels=labels)
        pad = CounterMetricFamily("neuronmm_bucket_padding_slots", "Padded (wasted) slots run per compiled bucket",
                                  labels=labels)
        for (phase, bucket), c in sorted((self.metrics.padding or {}).items()):
            key = [self.model_name, phase, str(bucket)]
            real.add_metric(key, c["real"])
            pad.add_metric(key, c["padding"])
        yield real
        yield pad


# neuronmm name -> the vLLM names it is also exported under (inter-token latency has an older vLLM name too)
VLLM_NAMES = {
    "neuronmm_time_to_first_token_seconds": ["vllm:time_to_first_token_seconds"],
    "neuronmm_inter_token_latency_seconds": ["vllm:inter_token_latency_seconds",
                                             "vllm:time_per_output_token_seconds"],
    "neuronmm_e2e_request_latency_seconds": ["vllm:e2e_request_latency_seconds"],
    "neuronmm_request_queue_time_seconds": ["vllm:request_queue_time_seconds"],
    "neuronmm_kv_cache_usage_perc": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "neuronmm_prefix_cache_queries": ["vllm:prefix_cache_queries"],
    "neuronmm_prefix_cache_hits": ["vllm:prefix_cache_hits"],
    "neuronmm_num_preemptions": ["vllm:num_preemptions"],
    "neuronmm_num_requests_running": ["vllm:num_requests_running"],
    "neuronmm_num_requests_waiting": ["vllm:num_requests_waiting"],
    "neuronmm_prompt_tokens": ["vllm:prompt_tokens"],
    "neuronmm_generation_tokens": ["vllm:generation_tokens"],
    "neuronmm_request_success": ["vllm:request_success"],
    "neuronmm_request_prompt_tokens": ["vllm:request_prompt_tokens"],
    "neuronmm_request_generation_tokens": ["vllm:request_generation_tokens"],
    "neuronmm_spec_decode_num_draft_tokens": ["vllm:spec_decode_num_draft_tokens"],
    "neuronmm_spec_decode_num_accepted_tokens": ["vllm:spec_decode_num_accepted_tokens"],
    "neuronmm_lora_requests_info": ["vllm:lora_requests_info"],
}


class _WithVllmNames:
    """Exports a registry's metrics, each followed by its copies under vLLM's names (same samples)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            yield family
            for alias in VLLM_NAMES.get(family.name, []):
                renamed = Metric(alias, family.documentation, family.type)
                renamed.samples = [s._replace(name=alias + s.name[len(family.name):]) for s in family.samples]
                yield renamed


class _KVCollector:
    """KV-cache usage, prefix-cache queries/hits and preemptions: the engine's totals, read at scrape time."""

    def __init__(self, model_name: str, metrics: "ServerMetrics"):
        self.model_name = model_name
        self.metrics = metrics

    def collect(self):
        kv = self.metrics.kv
        labels = [self.model_name]
        usage = GaugeMetricFamily("neuronmm_kv_cache_usage_perc", "Fraction of KV-cache blocks (or slots) in use",
                                  labels=["model_name"])
        usage.add_metric(labels, kv.num_used_blocks / kv.num_blocks if kv else 0.0)
        yield usage
        for name, doc, value in (
                ("neuronmm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", kv and kv.prefix_queries),
                ("neuronmm_prefix_cache_hits", "Prompt tokens found in the prefix cache", kv and kv.prefix_hits),
                ("neuronmm_num_preemptions", "Sequences preempted (freed and requeued) for lack of KV blocks",
                 kv and kv.preemptions)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value or 0)
            yield family


_MAX_PENDING_STEPS = 256
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """TTFT / inter-token / e2e histograms, running and waiting gauges, token and request counters."""

    def __init__(self, model_name: str):
        labels = {"model_name": model_name}
        reg = CollectorRegistry()  # the serving metrics, exported with their vLLM names
        self.registry = CollectorRegistry()
        self.registry.register(_WithVllmNames(reg))

        def hist(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=reg).labels(**labels)

        self.ttft = hist("neuronmm_time_to_first_token_seconds", "Time from arrival to first token")
        self.itl = hist("neuronmm_inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = hist("neuronmm_e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue_time = hist("neuronmm_request_queue_time_seconds", "Time from arrival to the running batch")
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
        self.draft_tokens = Counter("neuronmm_spec_decode_num_draft_tokens", "Speculative draft tokens checked",
                                    ["model_name"], registry=reg).labels(**labels)
        self.accepted_tokens = Counter("neuronmm_spec_decode_num_accepted_tokens",
                                       "Speculative draft tokens the model agreed with", ["model_name"],
                                       registry=reg).labels(**labels)
        self._requests = Counter("neuronmm_request_success", "Finished sequences by finish reason",
                                 ["model_name", "finished_reason"], registry=reg)
        token_buckets = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
        self.request_prompt_tokens = hist("neuronmm_request_prompt_tokens", "Prompt tokens per request",
                                          buckets=token_buckets)
        self.request_generation_tokens = hist("neuronmm_request_generation_tokens",
                                              "Generated tokens per finished choice", buckets=token_buckets)
        # vLLM's: one series, labelled with the adapters running and waiting, its value the time of the step
        self.lora_info = Gauge("neuronmm_lora_requests_info", "LoRA adapters of the running and waiting requests",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
        self._lora_labels: tuple[str, str, str] | None = None
        self._pending_steps: deque[StepStats] = deque()  # observed, not applied yet (observe_step)
        self._model_name = model_name
        reg.register(_KVCollector(model_name, self))
        self.kv: KVStats | None = None  # the engine's KV totals, as of its latest step
        self.padding: dict | None = None  # the backend's padding totals, as of the latest step
        self.registry.register(_PaddingCollector(model_name, self))
        self.http_requests = Counter("http_requests", "HTTP requests by method, route and status class",
                                     ["method", "handler", "status"], registry=self.registry)
        self.http_latency = Histogram("http_request_duration_seconds", "HTTP request handling time",
                                      ["method", "handler"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def watch_engine_core(self, pid: Callable[[], int | None]) -> None:
        """Export the engine core process's CPU, memory and file descriptors as `neuronmm_engine_core_process_*`
        (`process_*` are this, the API, process's: the model and the KV cache live in the core)."""
        ProcessCollector(namespace="neuronmm_engine_core", pid=lambda: pid() or "none", registry=self.registry)

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def observe_step(self, stats: StepStats) -> None:
        """Engine hook (its thread, or the event loop reading the engine process): a forward's tokens, latencies.

        Kept until the metrics are read (or a few hundred steps have come): a step's half-dozen observations under
        prometheus-client's locks cost ~120 us at c=1, where the engine's weight stream empties this process's
        caches between tokens, and a few us each when applied together.
        """
        self._pending_steps.append(stats)
        if len(self._pending_steps) >= _MAX_PENDING_STEPS:
            self._apply_pending_steps()

    def _apply_pending_steps(self) -> None:
        while self._pending_steps:  # popped one by one: the engine thread may append meanwhile
            self._apply_step(self._pending_steps.popleft())

    def _apply_step(self, stats: StepStats) -> None:
        self.batch_size.observe(stats.batch_size)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_draft_tokens:
            self.draft_tokens.inc(stats.num_draft_tokens)
            self.accepted_tokens.inc(stats.num_accepted_tokens)
        for ttft in stats.ttfts:
            self.ttft.observe(ttft)
        for queued in stats.queue_times:
            self.queue_time.observe(queued)
        if stats.kv is not None:
            self.kv = stats.kv
        if stats.padding is not None:
            self.padding = stats.padding
        if stats.lora is not None:
            self._observe_lora(stats.lora)
        for itl in stats.itls:
            self.itl.observe(itl)
        for reason, e2e in stats.finished:
            self.finished(reason, e2e)

    def _observe_lora(self, lora: LoraStats) -> None:
        labels = (str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running))
        if labels != self._lora_labels:  # one series: the current state's (vLLM keeps every one it set)
            self.lora_info.clear()
            self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def finished(self, reason: str, e2e_s: float | None = None) -> None:
        self._requests.labels(model_name=self._model_name, finished_reason=reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def observe_request(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One finished choice's token counts (the API side knows them per request)."""
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def observe_http(self, method: str, handler: str, status: int, seconds: float) -> None:
        self.http_requests.labels(method=method, handler=handler, status=f"{status // 100}xx").inc()
        self.http_latency.labels(method=method, handler=handler).observe(seconds)

    def render(self) -> bytes:
        self._apply_pending_steps()
        return generate_latest(self.registry)
