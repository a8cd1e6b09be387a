"""Helpers for e2e tests about the engines the local cluster's engine kubelet runs for kvfleet's engine pods.

The engine kubelet (e2e/cluster/localcluster/enginekubelet) serves every engine pod on the fake GPU nodes with a
real `kvfleet serve` on the pod's loopback IP; the pod is Ready only while the engine's /health answers. Tests
choose the tiny model for their namespaces (`MODEL_ANNOTATION`), read pods from the API, and may ask the engine
kubelet which process serves a pod (`engines`).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Mapping
from typing import Any

# The local model of the engine pods the tests make, set as this annotation on their namespaces: a tiny
# random-weight model starts in seconds; KVFLEET_E2E_ENGINE_MODEL=embedded runs them on SmolLM2 instead.
MODEL_ANNOTATION = "kvfleet.dev/local-engine-model"
E2E_ENGINE_MODEL = os.environ.get("KVFLEET_E2E_ENGINE_MODEL", "tiny")


def use_test_model(kube: Any, namespace: str) -> None:
    """Engine pods of `namespace` run the tests' model (`kube`: kvfleet.operator.kube.Kube)."""
    kube.merge_patch({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                     {"metadata": {"annotations": {MODEL_ANNOTATION: E2E_ENGINE_MODEL}}})


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Condition Ready=True and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])  # fmt: skip


def engine_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return 8000


def base_url(pod: Mapping[str, Any]) -> str:
    """http://POD_IP:PORT of an engine pod."""
    return f"http://{pod['status']['podIP']}:{engine_port(pod)}"


def container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    return ((pod.get("status") or {}).get("containerStatuses") or [{}])[0]


def engines(cluster: Any, namespace: str | None = None) -> list[dict[str, Any]]:
    """The engine kubelet's rows (GET /engines): namespace, pod, uid, ip, port, pid, model, state, ready,
    restarts, stopping, log."""
    url = f"http://127.0.0.1:{cluster.port('engine_kubelet')}/engines"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    with opener.open(url, timeout=5) as response:
        rows = json.loads(response.read())["engines"]
    return [r for r in rows if namespace is None or r["namespace"] == namespace]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False
