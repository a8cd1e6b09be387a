"""Prometheus metrics of the operator (served on 127.0.0.1 by default): reconciles, errors, durations,
and the desired / admitted / ready replicas of every ModelDeployment as its last reconcile saw them."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("kvfleet_operator_reconciles_total", "Reconciliations run.", ["kind"])
ERRORS = Counter("kvfleet_operator_reconcile_errors_total", "Reconciliations that failed.", ["kind"])
DURATION = Histogram("kvfleet_operator_reconcile_duration_seconds", "Time one reconciliation took.", ["kind"],
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
# What the operator's own client asks of the apiserver (kopf's watches and annotation patches not included),
# as client-go's rest_client_requests_total: the cost per reconcile at scale.
API_REQUESTS = Counter("kvfleet_operator_api_requests_total", "Requests of the operator's client to the apiserver.",
                       ["verb", "resource", "code"])


@contextmanager
def timed(kind: str) -> Iterator[None]:
    """Count one reconciliation of `kind`, its duration, and whether it raised."""
    RECONCILES.labels(kind).inc()
    start = time.perf_counter()
    try:
        yield
    except Exception:
        ERRORS.labels(kind).inc()
        raise
    finally:
        DURATION.labels(kind).observe(time.perf_counter() - start)


def replica_count(status: Mapping[str, Any], *keys: str) -> Optional[int]:
    """The first integer found at one of ``keys`` of a status dict (None if none)."""
    for key in keys:
        value = status.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


_MDEP_LABELS = ("namespace", "name")
# Gauge name -> the ModelDeployment status field it mirrors.
REPLICA_FIELDS = {"desired": "desiredReplicas", "admitted": "admittedReplicas", "ready": "readyReplicas"}


class ReplicaGauges:
    """kvfleet_operator_{desired,admitted,ready}_replicas{namespace,name}.

    Written by the operator's reconcile, the one place that computes these counts, so every
    ModelDeployment has them whether it autoscales or not; dropped when it is deleted.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.desired = Gauge("kvfleet_operator_desired_replicas", "Replicas the operator wants.",
                             _MDEP_LABELS, registry=registry)
        self.admitted = Gauge("kvfleet_operator_admitted_replicas", "Replicas whose Kueue workload is admitted.",
                              _MDEP_LABELS, registry=registry)
        self.ready = Gauge("kvfleet_operator_ready_replicas", "Replicas whose pod is ready.",
                           _MDEP_LABELS, registry=registry)

    def record(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Mirror a ModelDeployment's status counts; a count missing from status stays absent, never 0."""
        for attr, field in REPLICA_FIELDS.items():
            value = replica_count(status, field)
            if value is not None:
                getattr(self, attr).labels(namespace=namespace, name=name).set(value)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted ModelDeployment."""
        for gauge in (self.desired, self.admitted, self.ready):
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass


REPLICAS = ReplicaGauges()

_serving: tuple[str, int] | None = None


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Start the /metrics endpoint once per process (raises OSError if the port is taken)."""
    global _serving
    if _serving is None:
        start_http_server(port, addr=addr)
        _serving = (addr, port)
