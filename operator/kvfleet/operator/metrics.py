"""Prometheus metrics of the operator: reconciles, errors, durations (served on 127.0.0.1 by default)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prometheus_client import Counter, Histogram, start_http_server

RECONCILES = Counter("kvfleet_operator_reconciles_total", "Reconciliations run.", ["kind"])
ERRORS = Counter("kvfleet_operator_reconcile_errors_total", "Reconciliations that failed.", ["kind"])
DURATION = Histogram("kvfleet_operator_reconcile_duration_seconds", "Time one reconciliation took.", ["kind"],
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


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


_serving: tuple[str, int] | None = None


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Start the /metrics endpoint once per process (raises OSError if the port is taken)."""
    global _serving
    if _serving is None:
        start_http_server(port, addr=addr)
        _serving = (addr, port)
