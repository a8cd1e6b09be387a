"""Scenario: a change of resources (tensor parallel 1 -> 2) is replaced one workload at a time, and the
pods never ask for more GPUs than the tenant's quota (3), even mid-rollout: the replica that no longer fits
stays pending with Kueue's reason instead of running over quota."""
from __future__ import annotations

import time
from typing import Any

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, condition

from operator_fixtures import API, deployments, engine_pods, mdep_status, model_deployment, workloads

QUOTA = 3


def pod_gpus(kube: Kube, ns: str) -> int:
    return sum(int(c["resources"]["requests"]["nvidia.com/gpu"])
               for p in engine_pods(kube, ns, "roll") for c in p["spec"]["containers"])


def test_resource_change_rolls_within_quota(kube: Kube, tenants: Any, flavors: dict[str, str],
                                            operator: OperatorProcess) -> None:
    h200 = flavors["h200"]
    _, ns = tenants.create("roll", [{"flavor": h200, "nominal": QUOTA}])
    kube.apply(model_deployment("roll", ns, h200, replicas=2, tp=1))
    deadline = time.monotonic() + 60
    while mdep_status(kube, ns, "roll").get("readyReplicas") != 2:
        assert time.monotonic() < deadline, "2 replicas at tp=1 never became ready"
        time.sleep(0.3)
    old_uids = {w["metadata"]["uid"] for w in workloads(kube, ns, "roll")}

    kube.merge_patch(kube.get(API, "modeldeployments", "roll", ns), {"spec": {"engine": {"tensorParallelSize": 2}}})
    deadline, peak = time.monotonic() + 90, 0
    while True:
        used = pod_gpus(kube, ns)
        peak = max(peak, used)
        assert used <= QUOTA, f"pods ask for {used} GPUs, quota is {QUOTA}"
        st = mdep_status(kube, ns, "roll")
        wls = workloads(kube, ns, "roll")
        converged = (len(wls) == 2 and not {w["metadata"]["uid"] for w in wls} & old_uids
                     and st.get("admittedReplicas") == 1 and st.get("readyReplicas") == 1 and used == 2)
        if converged:
            break
        assert time.monotonic() < deadline, f"rollout did not converge: {st}"
        time.sleep(0.2)
    assert peak >= 2
    (pod,) = engine_pods(kube, ns, "roll")
    assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert len(deployments(kube, ns, "roll")) == 1  # the old shape's Deployment is gone
    mdep = kube.get(API, "modeldeployments", "roll", ns)
    assert condition(mdep, "QuotaExceeded")["status"] == "True"
    assert "insufficient unused quota" in condition(mdep, "QuotaExceeded")["message"]
