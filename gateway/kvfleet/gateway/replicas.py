"""Replicas of a model: the engine pods that may take requests, read from Pod objects."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

LABEL_MDEP = "serving.kvfleet.dev/modeldeployment"
ENGINE_PORT = 8000  # the engines' port (the operator's ENGINE_PORT) when the pod names none


@dataclass(frozen=True)
class Replica:
    """One ready engine: `name` is stable while the pod lives (it keys the ring and the load board)."""

    name: str  # namespace/pod
    url: str  # http://ip:port
    host: str


def _ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False  # terminating: its engine drains, send nothing new
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return ENGINE_PORT


def url_for(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def pod_replica(pod: Mapping[str, Any]) -> tuple[str, Replica] | None:
    """(model key `namespace/deployment`, replica) for a ready engine pod; None otherwise."""
    meta = pod.get("metadata") or {}
    deployment = (meta.get("labels") or {}).get(LABEL_MDEP)
    if not deployment or not _ready(pod):
        return None
    ip = str(pod["status"]["podIP"])
    name = f"{meta.get('namespace')}/{meta.get('name')}"
    return f"{meta.get('namespace')}/{deployment}", Replica(name, url_for(ip, _port(pod)), ip)


def replicas_by_model(pods: Iterable[Mapping[str, Any]]) -> dict[str, tuple[Replica, ...]]:
    out: dict[str, list[Replica]] = {}
    for pod in pods:
        found = pod_replica(pod)
        if found is not None:
            out.setdefault(found[0], []).append(found[1])
    return {key: tuple(sorted(reps, key=lambda r: r.name)) for key, reps in out.items()}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
