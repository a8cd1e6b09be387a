"""Scenario: `kubectl scale` beyond the tenant's quota -> the extra replicas wait with Kueue's reason and
never run; another tenant is admitted from its own quota; scaling back frees the waiting workloads."""
from __future__ import annotations

import time
from typing import Any, Callable

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, condition, wait_for

from operator_fixtures import API, deployments, engine_pods, mdep_status, model_deployment, workloads


def test_scale_beyond_quota_waits_and_never_runs(kube: Kube, tenants: Any, flavors: dict[str, str],
                                                  operator: OperatorProcess, kubectl: Callable[..., Any]) -> None:
    h200 = flavors["h200"]
    _, ns_a = tenants.create("quota-a", [{"flavor": h200, "nominal": 2}])
    _, ns_b = tenants.create("quota-b", [{"flavor": h200, "nominal": 2}])
    kube.apply(model_deployment("llm", ns_a, h200, replicas=1, tp=2))
    wait_for("llm ready", lambda: mdep_status(kube, ns_a, "llm").get("readyReplicas") == 1, timeout=90)

    kubectl("scale", "modeldeployment/llm", "--replicas=3", namespace=ns_a)
    mdep = wait_for("QuotaExceeded", lambda: (m := kube.get(API, "modeldeployments", "llm", ns_a))
                    and (condition(m, "QuotaExceeded") or {}).get("status") == "True" and m, timeout=60)
    quota = condition(mdep, "QuotaExceeded")
    assert quota["reason"] == "InsufficientQuota"
    assert "insufficient" in quota["message"] and "nvidia.com/gpu" in quota["message"], quota
    admitted = condition(mdep, "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "Pending" and "1/3" in admitted["message"]
    assert mdep["status"]["desiredReplicas"] == 3 and mdep["status"]["pendingReplicas"] == 2
    assert len(workloads(kube, ns_a, "llm")) == 3

    # For a while: never more than the one admitted replica's pod, and the Deployment asks for one.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert len(engine_pods(kube, ns_a, "llm")) <= 1
        time.sleep(0.5)
    assert [d["spec"]["replicas"] for d in deployments(kube, ns_a, "llm")] == [1]
    events = kube.list("v1", "events", ns_a)
    assert any(e["reason"] == "InsufficientQuota" and e["type"] == "Warning" for e in events)

    # Tenant B is admitted from its own quota while A waits.
    kube.apply(model_deployment("other", ns_b, h200, replicas=1, tp=2))
    wait_for("tenant B ready", lambda: mdep_status(kube, ns_b, "other").get("readyReplicas") == 1, timeout=90)
    assert mdep_status(kube, ns_a, "llm")["admittedReplicas"] == 1

    # Scale back: the waiting workloads are deleted at once, the condition clears.
    kubectl("scale", "modeldeployment/llm", "--replicas=1", namespace=ns_a)
    wait_for("pending workloads deleted", lambda: len(workloads(kube, ns_a, "llm")) == 1, timeout=30)
    wait_for("QuotaExceeded cleared", lambda: (condition({"status": mdep_status(kube, ns_a, "llm")},
                                                         "QuotaExceeded") or {}).get("status") == "False", timeout=30)
