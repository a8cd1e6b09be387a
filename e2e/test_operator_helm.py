"""Scenario: the Helm chart lints clean, renders what it should, and installs for real on the local
cluster; the operator (a local process) turns the chart's `tenants:` into ClusterQueues."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import REPO, OperatorProcess, wait_for

from local_engines import use_test_model
from operator_fixtures import API, KUEUE, helm, service_account_kubeconfig

CHART = REPO / "charts" / "kvfleet"


def values(sfx: str) -> dict[str, Any]:
    return {
        "operator": {"peeringName": f"kvfleet-helm-{sfx}"},
        "resourceFlavors": [{"name": f"h200-helm-{sfx}", "nodeLabels": {"kvfleet.dev/gpu-flavor": "h200"}}],
        "tenants": [{"name": f"helm-{sfx}", "namespaces": [f"helm-{sfx}"], "group": "helm-devs", "cohort": "c",
                     "quotas": [{"flavor": f"h200-helm-{sfx}", "nominal": 4, "borrowingLimit": 2}]}],
    }


def test_helm_lint_is_clean(cluster: Any) -> None:
    proc = helm(cluster, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in proc.stdout and "[WARNING]" not in proc.stdout, proc.stdout


def test_helm_template_renders(cluster: Any, tmp_path: Path) -> None:
    vals = tmp_path / "values.yaml"
    vals.write_text(yaml.safe_dump(values("t")))
    out = helm(cluster, "template", "rel", str(CHART), "--namespace", "kvfleet-system", "--kube-version", "v1.34.0",
               "-f", str(vals)).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "ResourceFlavor",
                            "Tenant", "ClusterKopfPeering",
                            # the gateway's
                            "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
                            "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]), kinds
    for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-kvfleet-operator")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["kvfleet", "operator"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "rel-kvfleet"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KVFLEET_AUTOSCALER_METRICS_SOURCE"] == "scrape"
    # Tenant NetworkPolicies admit the operator's namespace: its autoscaler scrapes the engines.
    assert env["KVFLEET_SYSTEM_NAMESPACES"] == "kvfleet-system"
    assert env["KVFLEET_NODE_CACHE_ROOTS"] == "/var/cache/kvfleet"
    # models whose engines want their own key: whether the chart's gateway may read it (GatewayKeyAccess)
    assert env["KVFLEET_GATEWAY_SERVICE_ACCOUNT"] == "kvfleet-system/rel-kvfleet-gateway"
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-kvfleet-operator")
    assert {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]} \
        in role["rules"]
    assert {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles", "clusterrolebindings"],
            "verbs": ["list", "watch"]} in role["rules"]
    tenant = next(d for d in docs if d["kind"] == "Tenant")
    assert tenant["spec"]["quotas"][0]["nominal"] == 4 and tenant["spec"]["cohort"] == "c"
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"


def test_helm_install_on_the_cluster(cluster: Any, kube: Kube, crds: None, kubectl: Callable[..., Any],
                                     tmp_path: Path) -> None:
    """Install for real, then run the operator with the chart's ServiceAccount: the least-privilege
    ClusterRole must be enough to turn the chart's tenant and a ModelDeployment into running replicas."""
    sfx = uuid.uuid4().hex[:5]
    release, ns, tenant = f"kvfleet-{sfx}", f"kvfleet-system-{sfx}", f"helm-{sfx}"
    vals = tmp_path / "values.yaml"
    vals.write_text(yaml.safe_dump(values(sfx)))
    operator = None
    try:
        helm(cluster, "install", release, str(CHART), "--namespace", ns, "--create-namespace", "-f", str(vals),
             "--wait", "--timeout", "90s")
        status = helm(cluster, "status", release, "--namespace", ns).stdout
        assert "STATUS: deployed" in status
        assert kube.get(KUEUE, "resourceflavors", f"h200-helm-{sfx}")["spec"]["nodeLabels"] == {
            "kvfleet.dev/gpu-flavor": "h200"}
        dep = kube.get("apps/v1", "deployments", f"{release}-operator", ns)
        assert dep["status"].get("availableReplicas") == 1  # a kwok pod: scheduled and Ready, never run

        sa_config = service_account_kubeconfig(cluster, kubectl, release, ns, tmp_path / "sa.kubeconfig")
        operator = OperatorProcess(sa_config, Path(cluster.logs) / "operator-helm-sa.log",
                                   peering=f"kvfleet-helm-{sfx}", identity=f"helm-{sfx}").start()
        cq = wait_for("ClusterQueue from the chart's tenant", lambda: kube.get(KUEUE, "clusterqueues", tenant),
                      timeout=60)
        gpu = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2]
        assert str(gpu["nominalQuota"]) == "4" and str(gpu["borrowingLimit"]) == "2"
        wait_for("LocalQueue", lambda: kube.get(KUEUE, "localqueues", tenant, tenant), timeout=30)
        # Applied after the LocalQueue in the same reconciliation: wait, don't race it.
        wait_for("RoleBinding", lambda: kube.get("rbac.authorization.k8s.io/v1", "rolebindings",
                                                 "kvfleet-modeldeployment-editor", tenant), timeout=30)
        use_test_model(kube, tenant)  # the pod's engine (the engine kubelet's) runs the tiny model
        kube.apply({"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": "m", "namespace": tenant},
                    "spec": {"model": {"source": "org/m"}, "resources": {"gpuFlavor": f"h200-helm-{sfx}"}}})
        # Ready: the pod's engine (the local cluster's engine kubelet runs one) answers /health.
        wait_for("ModelDeployment ready under the chart's RBAC",
                 lambda: ((kube.get(API, "modeldeployments", "m", tenant) or {}).get("status") or {})
                 .get("readyReplicas") == 1, timeout=180)
        log = operator.log_text()
        assert "forbidden" not in log.lower() and "HTTP 403" not in log, log[-3000:]
    finally:
        if operator is not None:
            kube.delete(API, "modeldeployments", "m", tenant)
            wait_for("ModelDeployment gone", lambda: kube.get(API, "modeldeployments", "m", tenant) is None,
                     timeout=60)
            operator.stop()
        helm(cluster, "uninstall", release, "--namespace", ns, "--wait", "--timeout", "60s", check=False)
        kube.delete("v1", "namespaces", ns)
        kube.delete("v1", "namespaces", tenant)
    wait_for("Tenant removed with the release", lambda: kube.get(API, "tenants", tenant) is None, timeout=60)
    wait_for("ClusterQueue collected", lambda: kube.get(KUEUE, "clusterqueues", tenant) is None, timeout=60)


pytestmark = pytest.mark.e2e
