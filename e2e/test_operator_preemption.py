"""Scenario: a tenant borrowing from its cohort is preempted when the lender reclaims its quota: the
preempted replica's pod goes away at once and its workload queues again with Kueue's reason."""
from __future__ import annotations

from typing import Any

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import engine_pods, mdep_status, model_deployment, workloads


def test_reclaimed_quota_preempts_the_borrower(kube: Kube, tenants: Any, flavors: dict[str, str],
                                               operator: OperatorProcess) -> None:
    h200 = flavors["h200"]
    _, lender = tenants.create("lender", [{"flavor": h200, "nominal": 2}], cohort="pool",
                               preemption={"reclaimWithinCohort": "Any"})
    _, borrower = tenants.create("borrower", [{"flavor": h200, "nominal": 0, "borrowingLimit": 2}], cohort="pool")

    kube.apply(model_deployment("guest", borrower, h200, replicas=1, tp=2))
    wait_for("borrower running on borrowed GPUs",
             lambda: mdep_status(kube, borrower, "guest").get("readyReplicas") == 1, timeout=60)
    (first,) = workloads(kube, borrower, "guest")

    kube.apply(model_deployment("owner", lender, h200, replicas=1, tp=2))
    wait_for("lender admitted", lambda: mdep_status(kube, lender, "owner").get("readyReplicas") == 1, timeout=90)

    # The borrower's replica went down and its workload (a new one) waits for quota again.
    st = wait_for("borrower pending again", lambda: (s := mdep_status(kube, borrower, "guest"))
                  .get("admittedReplicas") == 0 and s.get("pendingReplicas") == 1 and s, timeout=60)
    wait_for("borrower's pod gone", lambda: not engine_pods(kube, borrower, "guest"), timeout=60)
    (again,) = wait_for("a fresh workload", lambda: [w for w in workloads(kube, borrower, "guest")
                                                     if not w["metadata"].get("deletionTimestamp")], timeout=30)
    assert again["metadata"]["uid"] != first["metadata"]["uid"]
    assert not (again.get("status") or {}).get("admission")
    admitted = next(c for c in st["conditions"] if c["type"] == "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "Pending"
    assert len(engine_pods(kube, lender, "owner")) == 1
