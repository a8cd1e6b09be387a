"""Scenario: kill the operator (SIGKILL) in the middle of a reconciliation and start it again: it
converges to the same state with no duplicate workloads, Deployments or pods."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, deployments, engine_pods, mdep_status, model_deployment, workloads


@pytest.fixture(scope="module")
def operator(crds: None, kubeconfig: str, cluster: Any, kube: Kube) -> Iterator[OperatorProcess]:
    """A peered operator with a fixed identity (as a pod keeps its name across container restarts)."""
    peering = f"kvfleet-restart-{uuid.uuid4().hex[:5]}"
    kube.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    proc = OperatorProcess(kubeconfig, Path(cluster.logs) / "operator-restart.log", peering=peering,
                           identity="kvfleet-operator-0").start()
    yield proc
    proc.stop()
    kube.delete("kopf.dev/v1", "clusterkopfpeerings", peering)


def test_kill_mid_reconcile_then_converge(kube: Kube, tenants: Any, flavors: dict[str, str],
                                          operator: OperatorProcess) -> None:
    h200 = flavors["h200"]
    _, ns = tenants.create("restart", [{"flavor": h200, "nominal": 6}])
    kube.apply(model_deployment("svc", ns, h200, replicas=3, tp=2))
    # Kill it as soon as the first workload exists: the rest of the reconciliation never happens.
    wait_for("first workload", lambda: workloads(kube, ns, "svc"), timeout=60, interval=0.05)
    operator.kill()
    operator.start()

    st = wait_for("3 ready", lambda: (s := mdep_status(kube, ns, "svc")).get("readyReplicas") == 3
                  and s.get("admittedReplicas") == 3 and s, timeout=120)
    assert st["desiredReplicas"] == 3
    assert sorted(w["metadata"]["name"] for w in workloads(kube, ns, "svc")) == ["svc-0", "svc-1", "svc-2"]
    (dep,) = deployments(kube, ns, "svc")
    assert dep["metadata"]["name"].startswith(f"svc-{h200}-") and dep["spec"]["replicas"] == 3
    assert len(engine_pods(kube, ns, "svc")) == 3
    assert len(kube.list("v1", "services", ns, "serving.kvfleet.dev/modeldeployment=svc")) == 1
    assert len(kube.list("policy/v1", "poddisruptionbudgets", ns, "serving.kvfleet.dev/modeldeployment=svc")) == 1

    # And a restart with nothing to do changes nothing.
    operator.kill()
    operator.start()
    wait_for("status stays", lambda: mdep_status(kube, ns, "svc").get("readyReplicas") == 3, timeout=30)
    assert len(workloads(kube, ns, "svc")) == 3 and len(engine_pods(kube, ns, "svc")) == 3
    assert kube.get(API, "modeldeployments", "svc", ns)["status"]["admittedReplicas"] == 3
