"""Prometheus metrics of the gateway, per tenant and model (served on their own port, not to tenants).

Labels: `tenant`; `namespace` and `model` (the ModelDeployment's namespace and served name) once the
request's model resolved, empty before. Nothing a client chooses freely ever becomes a label value.

| metric | labels | what |
| --- | --- | --- |
| `kvfleet_gateway_requests_total` | tenant, namespace, model, code | requests answered, by HTTP status |
| `kvfleet_gateway_request_errors_total` | tenant, namespace, model, reason | requests that failed, by reason |
| `kvfleet_gateway_prompt_tokens_total` | tenant, namespace, model | prompt tokens (engines' usage) |
| `kvfleet_gateway_completion_tokens_total` | tenant, namespace, model | completion tokens (engines' usage) |
| `kvfleet_gateway_upstream_latency_seconds` | tenant, namespace, model | histogram: sent upstream -> answer ended |
| `kvfleet_gateway_upstream_first_byte_seconds` | tenant, namespace, model | histogram: to the first byte (TTFT) |
| `kvfleet_gateway_upstream_retries_total` | namespace, model, reason | failed before any byte, retried elsewhere |
| `kvfleet_gateway_routing_decisions_total` | namespace, model, rule | which routing rule chose the replica |
| `kvfleet_gateway_inflight_requests` | namespace, model | requests in flight to the model's replicas |
| `kvfleet_gateway_unauthenticated_requests_total` | reason | no key (`missing`) or an unknown key (`invalid`) |
| `kvfleet_gateway_api_keys` | tenant | keys loaded per tenant |
| `kvfleet_gateway_ready_replicas` | namespace, model | replicas the gateway may route to |
| `kvfleet_gateway_limited_requests_total` | tenant, limit | refused with 429 by a tenant limit |
| `kvfleet_gateway_tenant_requests_in_progress` | tenant | admitted here, queued or in flight |
| `kvfleet_gateway_queued_requests` | tenant, namespace, model | waiting here for a replica (per-tenant queue) |
| `kvfleet_gateway_queue_wait_seconds` | tenant, namespace, model | histogram: time waited before dispatch |
| `kvfleet_gateway_queue_outcomes_total` | tenant, namespace, model, outcome | how each wait ended |
| `kvfleet_gateway_model_waiting_requests` | namespace, modeldeployment | the autoscaler's demand signal |

Error reasons: `invalid_request` (400), `model_not_found` (404), `request_too_large` (413),
`no_replica` (503), `upstream_unavailable` (no replica answered), `upstream_error` (a replica's 5xx),
`upstream_disconnected` (a replica died mid-stream), `client_disconnected`, `stream_error` (an engine's
in-band error event), `rate_limited` (429, a tenant limit), `queue_full` (429), `quota_exceeded` (429,
Kueue keeps a model at zero), `not_admitted` (503), `wake_timeout` (504), `queue_timeout` (503),
`upstream_auth` (502: no key for an engine that wants its own, or every key refused).
Limits: `requests_per_minute`, `tokens_per_minute`, `concurrent_requests`. Queue outcomes:
`dispatched`, `quota_exceeded`, `not_admitted`, `wake_timeout`, `queue_timeout`, `client_disconnected`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # `_created` series double the output and no dashboard reads them

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
                   640.0)
MODEL_LABELS = ("tenant", "namespace", "model")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfleet_gateway_requests_total", "Requests answered, by HTTP status.",
                                [*MODEL_LABELS, "code"], registry=r)
        self.errors = Counter("kvfleet_gateway_request_errors_total", "Failed requests, by reason.",
                              [*MODEL_LABELS, "reason"], registry=r)
        self.prompt_tokens = Counter("kvfleet_gateway_prompt_tokens_total", "Prompt tokens, from the engines' usage.",
                                     MODEL_LABELS, registry=r)
        self.completion_tokens = Counter("kvfleet_gateway_completion_tokens_total",
                                         "Completion tokens, from the engines' usage.", MODEL_LABELS, registry=r)
        self.upstream_latency = Histogram("kvfleet_gateway_upstream_latency_seconds",
                                          "From sending upstream to the end of the replica's response.",
                                          MODEL_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("kvfleet_gateway_upstream_first_byte_seconds",
                                    "From sending upstream to the replica's first body byte.",
                                    MODEL_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("kvfleet_gateway_upstream_retries_total",
                               "Requests retried on another replica after a failure before the first byte.",
                               ["namespace", "model", "reason"], registry=r)
        self.routing = Counter("kvfleet_gateway_routing_decisions_total", "Replica choices, by routing rule.",
                               ["namespace", "model", "rule"], registry=r)
        self.inflight = Gauge("kvfleet_gateway_inflight_requests", "Requests in flight to the model's replicas.",
                              ["namespace", "model"], registry=r)
        self.unauthenticated = Counter("kvfleet_gateway_unauthenticated_requests_total",
                                       "Requests refused with 401: no key (missing) or an unknown key (invalid).",
                                       ["reason"], registry=r)
        self.api_keys = Gauge("kvfleet_gateway_api_keys", "API keys loaded, per tenant.", ["tenant"], registry=r)
        self.ready_replicas = Gauge("kvfleet_gateway_ready_replicas", "Replicas the gateway may route to.",
                                    ["namespace", "model"], registry=r)

        self.limited = Counter("kvfleet_gateway_limited_requests_total",
                               "Requests refused with 429 by a tenant limit, by limit.", ["tenant", "limit"],
                               registry=r)
        self.in_progress = Gauge("kvfleet_gateway_tenant_requests_in_progress",
                                 "Requests admitted by this gateway replica, not yet answered (queued or in flight).",
                                 ["tenant"], registry=r)
        self.queued = Gauge("kvfleet_gateway_queued_requests",
                            "Requests waiting at this gateway replica for a replica of the model, per tenant.",
                            MODEL_LABELS, registry=r)
        self.queue_wait = Histogram("kvfleet_gateway_queue_wait_seconds",
                                    "Time a request waited at the gateway before it was dispatched (or refused).",
                                    MODEL_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_outcomes = Counter("kvfleet_gateway_queue_outcomes_total", "How waits at the gateway ended.",
                                      [*MODEL_LABELS, "outcome"], registry=r)
        self.model_waiting = Gauge("kvfleet_gateway_model_waiting_requests",
                                   "Requests waiting at this gateway replica for a replica of the ModelDeployment "
                                   "(held while it scales from zero, or queued while its replicas are saturated): "
                                   "the operator's autoscaler adds them to the engines' queue depth.",
                                   ["namespace", "modeldeployment"], registry=r)

        self._series: dict[tuple[str, str, str], ModelSeries] = {}

    def series(self, tenant: str, namespace: str = "", model: str = "") -> "ModelSeries":
        """The children of one (tenant, namespace, model), made once: `labels()` costs a lock and a hash per call."""
        key = (tenant, namespace, model)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = ModelSeries(self, key)
        return found

    def set_inventory(self, keys_per_tenant: Mapping[str, int], replicas: Iterable[tuple[str, str, int]]) -> None:
        """Replace the key and replica gauges (after a snapshot change): gone tenants and models vanish."""
        self.api_keys.clear()
        for tenant, n in keys_per_tenant.items():
            self.api_keys.labels(tenant).set(n)
        self.ready_replicas.clear()
        for namespace, model, n in replicas:
            self.ready_replicas.labels(namespace, model).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelSeries:
    """One tenant's series of one model (namespace and model empty before the model resolved)."""

    def __init__(self, m: GatewayMetrics, key: tuple[str, str, str]) -> None:
        self._m, self._key = m, key
        tenant, namespace, model = key
        self.prompt_tokens = m.prompt_tokens.labels(*key)
        self.completion_tokens = m.completion_tokens.labels(*key)
        self.upstream_latency = m.upstream_latency.labels(*key)
        self.first_byte = m.first_byte.labels(*key)
        self.inflight = m.inflight.labels(namespace, model)
        self.queued = m.queued.labels(*key)
        self.queue_wait = m.queue_wait.labels(*key)
        self._codes: dict[str, Any] = {}
        self._errors: dict[str, Any] = {}
        self._rules: dict[str, Any] = {}
        self._retries: dict[str, Any] = {}

    def answered(self, status: int) -> None:
        code = str(status)
        child = self._codes.get(code)
        if child is None:
            child = self._codes[code] = self._m.requests.labels(*self._key, code)
        child.inc()

    def failed(self, reason: str) -> None:
        child = self._errors.get(reason)
        if child is None:
            child = self._errors[reason] = self._m.errors.labels(*self._key, reason)
        child.inc()

    def routed(self, rule: str) -> None:
        child = self._rules.get(rule)
        if child is None:
            child = self._rules[rule] = self._m.routing.labels(self._key[1], self._key[2], rule)
        child.inc()

    def retried(self, reason: str) -> None:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self._m.retries.labels(self._key[1], self._key[2], reason)
        child.inc()

    def waited(self, outcome: str, seconds: float) -> None:
        self._m.queue_outcomes.labels(*self._key, outcome).inc()
        self.queue_wait.observe(seconds)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)
