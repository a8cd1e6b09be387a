"""Metric sources for the autoscaler: scrape each pod's /metrics, or ask Prometheus.

Both return one :class:`PodLoad` per ready pod; a pod that cannot be read comes back
with ``None`` values and the error, never as zero (see ``policy``). A missing metric
name counts as unreadable too, so a metric rename shows up as "unknown" in status
instead of silently reading as an idle engine.

Safety: with ``KVFLEET_LOOPBACK_ONLY=1`` no request ever leaves 127.0.0.0/8: a pod
IP or Prometheus URL outside it is refused (the pod counts as unknown).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator.autoscaler.policy import PodLoad

log = logging.getLogger(__name__)

LOOPBACK_ENV = "KVFLEET_LOOPBACK_ONLY"

# engine.kind -> metric prefix; the vLLM names are what vLLM itself exports.
PREFIXES = {"kvfleet": "kvfleet:", "vllm": "vllm:"}


class MetricsError(Exception):
    """A pod's load could not be read."""


@dataclass(frozen=True)
class PodTarget:
    """A ready pod to read: its name and the address the API server reports."""

    name: str
    ip: str
    port: int


def metric_names(engine_kind: str) -> tuple[str, str]:
    """(waiting, running) metric names for an engine kind."""
    try:
        prefix = PREFIXES[engine_kind]
    except KeyError:
        raise ValueError(
            f"engine.kind must be one of {sorted(PREFIXES)}, got {engine_kind!r}"
        ) from None
    return prefix + "num_requests_waiting", prefix + "num_requests_running"


def loopback_only() -> bool:
    return os.environ.get(LOOPBACK_ENV, "").lower() in ("1", "true", "yes")


def check_host(host: str) -> None:
    """Raise MetricsError when loopback-only is on and ``host`` is not loopback."""
    if not loopback_only():
        return
    if host == "localhost":
        return
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise MetricsError(f"refusing non-IP host {host!r} ({LOOPBACK_ENV}=1)") from None
    if not addr.is_loopback:
        raise MetricsError(f"refusing non-loopback address {host} ({LOOPBACK_ENV}=1)")


def parse_load(text: str, engine_kind: str = "kvfleet") -> tuple[float, float]:
    """(waiting, running) from Prometheus text; sums over label sets (e.g. model_name)."""
    waiting_name, running_name = metric_names(engine_kind)
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (waiting_name, running_name):
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError as exc:  # the parser raises ValueError on malformed text
        raise MetricsError(f"malformed metrics text: {exc}") from exc
    missing = [n for n in (waiting_name, running_name) if n not in totals]
    if missing:
        raise MetricsError(f"metrics missing: {', '.join(missing)}")
    return totals[waiting_name], totals[running_name]


def unknown(pod: str, error: str) -> PodLoad:
    return PodLoad(pod=pod, waiting=None, running=None, error=error)


async def scrape_pods(
    targets: Sequence[PodTarget],
    engine_kind: str = "kvfleet",
    timeout: float = 2.0,
    client: Optional[httpx.AsyncClient] = None,
) -> list[PodLoad]:
    """Scrape every target's ``/metrics`` concurrently."""
    import asyncio

    own = client is None
    # trust_env=False: never route pod traffic through a proxy from the environment.
    client = client or httpx.AsyncClient(timeout=timeout, trust_env=False)
    try:
        return list(await asyncio.gather(*(_scrape(client, t, engine_kind) for t in targets)))
    finally:
        if own:
            await client.aclose()


async def _scrape(client: httpx.AsyncClient, target: PodTarget, engine_kind: str) -> PodLoad:
    try:
        check_host(target.ip)
        host = f"[{target.ip}]" if ":" in target.ip else target.ip
        resp = await client.get(f"http://{host}:{target.port}/metrics")
        resp.raise_for_status()
        waiting, running = parse_load(resp.text, engine_kind)
    except (MetricsError, httpx.HTTPError) as exc:
        log.debug("scrape failed", extra={"pod": target.name, "error": str(exc)})  # status + Event say it
        return unknown(target.name, f"{type(exc).__name__}: {exc}")
    return PodLoad(pod=target.name, waiting=waiting, running=running)


def prometheus_query(metric: str, namespace: str, pods: Iterable[str]) -> str:
    """PromQL selecting ``metric`` for the given pods, summed per pod."""
    names = "|".join(sorted(pods))
    return f'sum by (pod) ({metric}{{namespace="{namespace}",pod=~"{names}"}})'


def parse_prometheus_vector(body: dict) -> dict[str, float]:
    """``{pod: value}`` from an ``/api/v1/query`` response with a vector result."""
    if body.get("status") != "success":
        raise MetricsError(f"prometheus query failed: {body.get('error', body.get('status'))}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise MetricsError(f"prometheus result type {data.get('resultType')!r}, expected vector")
    out: dict[str, float] = {}
    for item in data.get("result", []):
        pod = item.get("metric", {}).get("pod")
        if pod is not None:
            out[pod] = float(item["value"][1])
    return out


async def query_prometheus(
    url: str,
    namespace: str,
    pods: Sequence[str],
    engine_kind: str = "kvfleet",
    timeout: float = 2.0,
) -> list[PodLoad]:
    """Read each pod's load from a Prometheus server; pods absent from the answer are unknown."""
    if not pods:
        return []
    waiting_name, running_name = metric_names(engine_kind)
    try:
        check_host(urlsplit(url).hostname or "")
        async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as client:
            values = []
            for metric in (waiting_name, running_name):
                resp = await client.get(
                    "/api/v1/query", params={"query": prometheus_query(metric, namespace, pods)}
                )
                resp.raise_for_status()
                values.append(parse_prometheus_vector(resp.json()))
    except (MetricsError, httpx.HTTPError, ValueError) as exc:
        log.info("prometheus query failed", extra={"url": url, "error": str(exc)})
        return [unknown(p, f"{type(exc).__name__}: {exc}") for p in pods]
    waiting, running = values
    return [
        PodLoad(pod=p, waiting=waiting[p], running=running[p])
        if p in waiting and p in running
        else unknown(p, "no series in prometheus")
        for p in pods
    ]
