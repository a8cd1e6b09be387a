"""Which pods the autoscaler reads: the ready pods of a ModelDeployment, as the API server reports them."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kvfleet.operator.autoscaler.metrics import PodTarget


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, not being deleted, with condition Ready=True and an IP."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def container_port(pod: Mapping[str, Any], default: int) -> int:
    """The port named ``http`` of the first container that declares it, else ``default``."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return default


def ready_targets(pods: Iterable[Mapping[str, Any]], default_port: int = 8000) -> list[PodTarget]:
    """Scrape targets for the ready pods, sorted by name (stable decisions and logs)."""
    out = [
        PodTarget(p["metadata"]["name"], p["status"]["podIP"], container_port(p, default_port))
        for p in pods
        if is_ready(p)
    ]
    return sorted(out, key=lambda t: t.name)
