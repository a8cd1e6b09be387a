"""Prometheus text scrapes of the control plane's /metrics, reduced to the counters the benchmark compares."""
from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels kept)


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    cert: Path | None = None
    key: Path | None = None
    token: str | None = None  # a bearer token (Kueue's metrics authenticate with TokenReview)


def fetch(endpoint: Endpoint, timeout: float = 10.0) -> str:
    context = None
    if endpoint.url.startswith("https://"):
        context = ssl._create_unverified_context()  # loopback, our own CA: only reading counters
        if endpoint.cert and endpoint.key:
            context.load_cert_chain(str(endpoint.cert), str(endpoint.key))
    request = urllib.request.Request(endpoint.url)
    if endpoint.token:
        request.add_header("Authorization", f"Bearer {endpoint.token}")
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:  # noqa: S310
        return response.read().decode()


def reduce(text: str, wanted: Mapping[str, Iterable[str]]) -> dict[Key, float]:
    """The samples named in `wanted` (sample name -> labels to keep), summed over the labels dropped."""
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            keep = wanted.get(s.name)
            if keep is None:
                continue
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in keep)))
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def diff(after: Mapping[Key, float], before: Mapping[Key, float]) -> dict[Key, float]:
    """Counter increments (new series count from 0); unchanged series are left out."""
    out = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if delta:
            out[key] = delta
    return out


def as_rows(values: Mapping[Key, float]) -> list[dict[str, object]]:
    """JSON-friendly rows, largest first."""
    rows = [{"metric": name, **dict(labels), "value": round(v, 3)} for (name, labels), v in values.items()]
    return sorted(rows, key=lambda r: (str(r["metric"]), -float(r["value"])))  # type: ignore[arg-type]


# What each component's scrape is reduced to.
APISERVER = {
    "apiserver_request_total": ("verb", "resource", "code"),
    "apiserver_request_duration_seconds_sum": ("verb",),
    "apiserver_request_duration_seconds_count": ("verb",),
    # API Priority and Fairness: time requests waited in its queues, per priority level.
    "apiserver_flowcontrol_request_wait_duration_seconds_sum": ("priority_level",),
    "apiserver_flowcontrol_request_wait_duration_seconds_count": ("priority_level",),
    "apiserver_flowcontrol_rejected_requests_total": ("priority_level", "reason"),
    "etcd_request_duration_seconds_sum": ("operation",),
    "etcd_request_duration_seconds_count": ("operation",),
}
# client-go's own counters (controller manager, scheduler, Kueue): requests and the time spent waiting in the
# client's rate limiter (QPS/burst).
CLIENT = {
    "rest_client_requests_total": ("method", "code"),
    "rest_client_rate_limiter_duration_seconds_sum": (),
    "rest_client_rate_limiter_duration_seconds_count": (),
    "rest_client_request_duration_seconds_sum": ("verb",),
    "rest_client_request_duration_seconds_count": ("verb",),
}
KUEUE = {
    **CLIENT,
    "kueue_admission_attempts_total": ("result",),
    "kueue_admission_attempt_duration_seconds_sum": ("result",),
    "kueue_admission_attempt_duration_seconds_count": ("result",),
    "controller_runtime_reconcile_total": ("controller",),
    "controller_runtime_reconcile_time_seconds_sum": ("controller",),
}
OPERATOR = {
    "kvfleet_operator_api_requests_total": ("verb", "resource"),
    "kvfleet_operator_reconciles_total": ("kind",),
    "kvfleet_operator_reconcile_errors_total": ("kind",),
    "kvfleet_operator_reconcile_duration_seconds_sum": ("kind",),
}
