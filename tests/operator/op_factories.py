"""Plain-dict factories for the operator's pure functions (no cluster)."""
from __future__ import annotations

from typing import Any

from kvfleet.operator.constants import LABEL_MDEP, LABEL_ORDINAL, LABEL_WORKLOAD_HASH


def make_mdep(spec: dict[str, Any] | None = None, name: str = "llama", namespace: str = "team-a",
              status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "serving.kvfleet.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-1234", "generation": 3},
        "spec": spec if spec is not None else {"model": {"source": "meta-llama/Llama-3.1-8B-Instruct"}},
        "status": status or {},
    }


def make_workload(ordinal: int, *, mdep: str = "llama", spec_hash: str = "h", admitted: bool = False,
                  flavor: str | None = None, evicted: bool = False, terminating: bool = False,
                  pending_message: str | None = None, gpus: int = 1, active: bool = True) -> dict[str, Any]:
    conditions = []
    status: dict[str, Any] = {}
    if admitted:
        conditions += [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "ok"},
                       {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "ok"}]
        status["admission"] = {"clusterQueue": "team-a", "podSetAssignments": [
            {"name": "main", "flavors": {"cpu": flavor, "memory": flavor, "nvidia.com/gpu": flavor},
             "count": 1}]}
    elif pending_message:
        conditions.append({"type": "QuotaReserved", "status": "False", "reason": "Pending",
                           "message": pending_message})
    if evicted:
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted"})
    status["conditions"] = conditions
    meta: dict[str, Any] = {"name": f"{mdep}-{ordinal}", "namespace": "team-a",
                            "labels": {LABEL_MDEP: mdep, LABEL_ORDINAL: str(ordinal), LABEL_WORKLOAD_HASH: spec_hash}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": meta,
        "spec": {"active": active, "queueName": "team-a", "podSets": [{"name": "main", "count": 1, "template": {
            "spec": {"containers": [{"name": "engine", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]}}}]},
        "status": status,
    }
