"""Scenario: deleting a ModelDeployment removes its pods, Service and workloads and frees the quota
(a second model that needs the same GPUs is admitted). Along the way the operator's replica gauges
(scraped from its loopback /metrics) match each non-autoscaled ModelDeployment's status, and a deleted
one's series disappear."""
from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, deployments, engine_pods, mdep_status, model_deployment, workloads

COUNTS = ("desired", "admitted", "ready")


def replica_gauges(operator: OperatorProcess, namespace: str, name: str) -> dict[str, float]:
    """kvfleet_operator_{desired,admitted,ready}_replicas of one ModelDeployment, as the operator serves them."""
    out = {}
    for family in text_string_to_metric_families(operator.metrics()):
        for s in family.samples:
            if s.labels == {"namespace": namespace, "name": name} and s.name.endswith("_replicas"):
                out[s.name.removeprefix("kvfleet_operator_").removesuffix("_replicas")] = s.value
    return out


def gauges_match_status(kube: Kube, operator: OperatorProcess, namespace: str, name: str) -> dict[str, float]:
    """Waits until the gauges equal status.{desired,admitted,ready}Replicas (the status is written just
    before the gauges, in the same reconcile); returns them."""
    def same() -> dict[str, float] | None:
        st = mdep_status(kube, namespace, name)
        gauges = replica_gauges(operator, namespace, name)
        return gauges if gauges == {k: float(st.get(f"{k}Replicas", -1)) for k in COUNTS} else None
    return wait_for(f"{name}'s replica gauges equal its status", same, timeout=15)


def test_delete_frees_everything(kube: Kube, tenants: Any, flavors: dict[str, str],
                                 operator: OperatorProcess) -> None:
    h200 = flavors["h200"]
    _, ns = tenants.create("del", [{"flavor": h200, "nominal": 4}])
    kube.apply(model_deployment("first", ns, h200, replicas=2, tp=2))
    wait_for("first ready", lambda: mdep_status(kube, ns, "first").get("readyReplicas") == 2, timeout=90)
    assert gauges_match_status(kube, operator, ns, "first") == {"desired": 2, "admitted": 2, "ready": 2}
    kube.apply(model_deployment("second", ns, h200, replicas=1, tp=2))
    wait_for("second pending on quota", lambda: mdep_status(kube, ns, "second").get("pendingReplicas") == 1
             and any(c["type"] == "QuotaExceeded" and c["status"] == "True"
                     for c in mdep_status(kube, ns, "second").get("conditions", [])), timeout=60)
    assert gauges_match_status(kube, operator, ns, "second") == {"desired": 1, "admitted": 0, "ready": 0}

    kube.delete(API, "modeldeployments", "first", ns)
    wait_for("first's pods gone", lambda: not kube.list("v1", "pods", ns, "serving.kvfleet.dev/modeldeployment=first"),
             timeout=90)
    wait_for("first's workloads gone", lambda: not workloads(kube, ns, "first"), timeout=60)
    wait_for("first's Service gone", lambda: kube.get("v1", "services", "first", ns) is None, timeout=60)
    wait_for("first's disruption budget gone",
             lambda: kube.get("policy/v1", "poddisruptionbudgets", "first", ns) is None, timeout=60)
    wait_for("first's Deployment gone", lambda: not deployments(kube, ns, "first"), timeout=60)
    wait_for("first's replica gauges gone", lambda: not replica_gauges(operator, ns, "first"), timeout=15)
    # The freed quota admits the waiting model.
    wait_for("second ready", lambda: mdep_status(kube, ns, "second").get("readyReplicas") == 1, timeout=90)
    assert len(engine_pods(kube, ns, "second")) == 1
    assert gauges_match_status(kube, operator, ns, "second") == {"desired": 1, "admitted": 1, "ready": 1}
