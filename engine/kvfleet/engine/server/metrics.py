"""Prometheus metrics, named like vLLM's with the `kvfleet:` prefix.

Engine-wide gauges and counters are read from `engine.stats()` at scrape time (a
custom collector), so `kvfleet:num_requests_waiting` is the exact queue depth at every
scrape, which the operator's autoscaler relies on. Per-request counters and latency
histograms are recorded by the server as requests finish.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet.engine.outputs import RequestMetrics

disable_created_metrics()  # `_created` series double the output and no dashboard reads them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, stats() key, help) for values the engine owns.
_GAUGES = (
    ("kvfleet:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled (queue depth)."),
    ("kvfleet:num_requests_running", "num_running", "Requests in the running batch."),
)
_COUNTERS = (
    ("kvfleet:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("kvfleet:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("kvfleet:num_preemptions", "num_preemptions", "Requests preempted for lack of KV blocks."),
    ("kvfleet:prompt_tokens", "prompt_tokens", "Prefill tokens processed."),
    ("kvfleet:generation_tokens", "generation_tokens", "Tokens generated."),
)


class EngineStatsCollector(Collector):
    """Turns one `stats()` call per scrape into gauges and counters labelled by model."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if not stats:  # engine not loaded yet: report nothing rather than a false zero
            return
        for name, key, help_text in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self._model_name], float(stats.get(key, 0)))
            yield family
        usage = GaugeMetricFamily("kvfleet:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                  labels=["model_name"])
        usage.add_metric([self._model_name], float(stats.get("kv_cache_usage", 0.0)))
        yield usage
        for name, key, help_text in _COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric([self._model_name], float(stats.get(key, 0)))
            yield counter


def request_timings(metrics: RequestMetrics | None) -> dict[str, float]:
    """TTFT, end-to-end and queue time in seconds from a RequestOutput's `metrics` (missing -> left out)."""
    if metrics is None:
        return {}
    arrival = metrics.arrival_time
    out: dict[str, float] = {}
    for key, value in (("ttft", metrics.first_token_time), ("e2e", metrics.finished_time),
                       ("queue", metrics.first_scheduled_time)):
        if value is not None and value >= arrival:
            out[key] = value - arrival
    return out


class ServerMetrics:
    """All metrics of one served model, in a registry of their own."""

    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, Any] | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(model_name, stats))
        self.request_success = Counter(
            "kvfleet:request_success", "Finished requests by finish reason (stop, length, abort).",
            ["model_name", "tenant", "finished_reason"], registry=self.registry)
        self.request_rejected = Counter(
            "kvfleet:request_rejected", "Requests refused before reaching the engine (queue_full, draining).",
            ["model_name", "tenant", "reason"], registry=self.registry)
        self.ttft = Histogram("kvfleet:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvfleet:inter_token_latency_seconds", "Time between successive output tokens.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvfleet:e2e_request_latency_seconds", "Arrival to finish.", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("kvfleet:request_queue_time_seconds", "Arrival to first scheduled.",
                                    ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe_finished(self, tenant: str, finished_reason: str, request_metrics: RequestMetrics | None) -> None:
        """One finished engine request (all its `n` choices together)."""
        self.request_success.labels(self.model_name, tenant, finished_reason).inc()
        timings = request_timings(request_metrics)
        for key, hist in (("ttft", self.ttft), ("e2e", self.e2e), ("queue", self.queue_time)):
            if key in timings:
                hist.labels(self.model_name).observe(timings[key])

    def observe_itl(self, seconds: float, tokens: int) -> None:
        """`tokens` new tokens arrived `seconds` after the previous ones: one sample per token."""
        if tokens <= 0 or seconds < 0:
            return
        child = self.itl.labels(self.model_name)
        for _ in range(tokens):
            child.observe(seconds / tokens)

    def observe_rejected(self, tenant: str, reason: str) -> None:
        self.request_rejected.labels(self.model_name, tenant, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
