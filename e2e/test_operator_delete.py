"""Scenario: deleting a ModelDeployment removes its pods, Service and workloads and frees the quota
(a second model that needs the same GPUs is admitted)."""
from __future__ import annotations

from typing import Any

from operator_fixtures import (API, KUEUE, crds, deployments, engine_pods, flavors, kube, mdep_status,  # noqa: F401
                               model_deployment, operator, suffix, tenants, workloads)

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for


def test_delete_frees_everything(kube: Kube, tenants: Any, flavors: dict[str, str],
                                 operator: OperatorProcess) -> None:
    h200 = flavors["h200"]
    _, ns = tenants.create("del", [{"flavor": h200, "nominal": 4}])
    kube.apply(model_deployment("first", ns, h200, replicas=2, tp=2))
    wait_for("first ready", lambda: mdep_status(kube, ns, "first").get("readyReplicas") == 2, timeout=90)
    kube.apply(model_deployment("second", ns, h200, replicas=1, tp=2))
    wait_for("second pending on quota", lambda: mdep_status(kube, ns, "second").get("pendingReplicas") == 1
             and any(c["type"] == "QuotaExceeded" and c["status"] == "True"
                     for c in mdep_status(kube, ns, "second").get("conditions", [])), timeout=60)

    kube.delete(API, "modeldeployments", "first", ns)
    wait_for("first's pods gone", lambda: not kube.list("v1", "pods", ns, "serving.kvfleet.dev/modeldeployment=first"),
             timeout=90)
    wait_for("first's workloads gone", lambda: not workloads(kube, ns, "first"), timeout=60)
    wait_for("first's Service gone", lambda: kube.get("v1", "services", "first", ns) is None, timeout=60)
    wait_for("first's Deployment gone", lambda: not deployments(kube, ns, "first"), timeout=60)
    # The freed quota admits the waiting model.
    wait_for("second ready", lambda: mdep_status(kube, ns, "second").get("readyReplicas") == 1, timeout=90)
    assert len(engine_pods(kube, ns, "second")) == 1
