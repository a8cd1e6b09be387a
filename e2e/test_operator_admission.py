"""Scenario: a Tenant and a ModelDeployment -> Kueue admits each replica's workload -> the Deployment's
pods run on GPU nodes of the assigned flavor -> Available, with endpoint, Service and tenant objects."""
from __future__ import annotations

from typing import Any

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, condition, wait_for

from operator_fixtures import (
    API,
    KUEUE,
    SYSTEM_NAMESPACE,
    deployments,
    engine_pods,
    model_deployment,
    workloads,
)


def test_admitted_replicas_run_on_the_flavors_nodes(kube: Kube, tenants: Any, flavors: dict[str, str],
                                                     operator: OperatorProcess, cluster_objects: Any,
                                                     kubectl: Any) -> None:
    tenant, ns = tenants.create("acme", [{"flavor": flavors["h200"], "nominal": 4}], group="acme-devs")
    priority = f"serving-{tenants.suffix}"
    cluster_objects.create("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses", {
        "apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": priority}, "value": 1000})
    kube.apply(model_deployment("chat", ns, flavors["h200"], replicas=2, tp=2, priorityClassName=priority))

    mdep = wait_for("chat Available", lambda: (m := kube.get(API, "modeldeployments", "chat", ns))
                    and (condition(m, "Available") or {}).get("status") == "True"
                    and m["status"].get("readyReplicas") == 2 and m, timeout=90)
    st = mdep["status"]
    assert condition(mdep, "Admitted")["status"] == "True", st
    assert condition(mdep, "QuotaExceeded")["status"] == "False"
    assert (st["desiredReplicas"], st["admittedReplicas"]) == (2, 2)
    assert st["endpoint"] == f"http://chat.{ns}.svc.cluster.local:8000/v1"
    assert st["observedGeneration"] == mdep["metadata"]["generation"]

    # One Kueue workload per replica, each admitted with the h200 flavor, owned by the ModelDeployment.
    wls = workloads(kube, ns, "chat")
    assert sorted(w["metadata"]["name"] for w in wls) == ["chat-0", "chat-1"]
    for wl in wls:
        assert wl["status"]["admission"]["clusterQueue"] == tenant
        (psa,) = wl["status"]["admission"]["podSetAssignments"]
        assert psa["flavors"]["nvidia.com/gpu"] == flavors["h200"]
        assert wl["metadata"]["ownerReferences"][0]["uid"] == mdep["metadata"]["uid"]
        assert wl["spec"]["priority"] == 1000 and wl["spec"]["priorityClassRef"]["name"] == priority

    # Pods: Running on H200 nodes, 2 GPUs each; the Deployment asks for exactly the admitted count.
    pods = engine_pods(kube, ns, "chat")
    assert len(pods) == 2
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        node = kube.get("v1", "nodes", pod["spec"]["nodeName"])
        assert node["metadata"]["labels"]["kvfleet.dev/gpu-flavor"] == "h200"
        assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert pod["spec"]["containers"][0]["command"] == ["kvfleet", "serve"]
    (dep,) = deployments(kube, ns, "chat")
    assert dep["metadata"]["name"].startswith(f"chat-{flavors['h200']}-") and dep["spec"]["replicas"] == 2
    svc = kube.get("v1", "services", "chat", ns)
    assert svc["spec"]["ports"][0]["port"] == 8000
    # Its disruption budget, as Kubernetes' disruption controller reads it: both replicas healthy, a drain may
    # evict one of them.
    pdb = wait_for("disruption budget counted", lambda: (b := kube.get("policy/v1", "poddisruptionbudgets", "chat", ns))
                   and (b.get("status") or {}).get("currentHealthy") == 2 and b, timeout=60)
    assert (pdb["status"]["expectedPods"], pdb["status"]["desiredHealthy"], pdb["status"]["disruptionsAllowed"]) \
        == (2, 1, 1), pdb["status"]
    # Someone deletes the budget and edits the Service's port: the operator's watches put both back. The port's
    # new number makes the operator's apply invalid (its entry would repeat the name), so it repairs the Service
    # and says so in an Event.
    kubectl("delete", "pdb", "chat", namespace=ns)
    kubectl("patch", "service", "chat", "--type=merge", "-p",
            '{"spec":{"ports":[{"name":"http","port":8001,"targetPort":9000}]}}', namespace=ns)
    wait_for("budget back", lambda: kube.get("policy/v1", "poddisruptionbudgets", "chat", ns), timeout=60)
    wait_for("Service's port back", lambda: kube.get("v1", "services", "chat", ns)["spec"]["ports"]
             == [{"name": "http", "protocol": "TCP", "port": 8000, "targetPort": "http"}], timeout=60)
    repaired = wait_for("ChildRepaired event", lambda: [
        e for e in kube.list("v1", "events", ns) if e["reason"] == "ChildRepaired"
        and e["involvedObject"]["name"] == "chat"], timeout=30)
    assert "Service chat put back" in repaired[0]["message"] and "Duplicate value" in repaired[0]["message"]
    # The same for the Deployment: someone renumbers the engine container's port.
    dep_name = dep["metadata"]["name"]
    kubectl("patch", "deployment", dep_name, "--type=json", "-p", '[{"op": "replace", "path": '
            '"/spec/template/spec/containers/0/ports/0/containerPort", "value": 8001}]', namespace=ns)
    wait_for("container port back", lambda: kube.get("apps/v1", "deployments", dep_name, ns)["spec"]["template"]
             ["spec"]["containers"][0]["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
             timeout=60)
    wait_for("ChildRepaired event of the Deployment", lambda: [
        e for e in kube.list("v1", "events", ns)
        if e["reason"] == "ChildRepaired" and f"Deployment {dep_name} put back" in e["message"]], timeout=30)

    # The tenant's objects and its usage.
    cq = kube.get(KUEUE, "clusterqueues", tenant)
    assert cq["spec"]["resourceGroups"][0]["flavors"][0]["name"] == flavors["h200"]
    assert kube.get("networking.k8s.io/v1", "networkpolicies", "kvfleet-tenant-isolation", ns)
    binding = kube.get("rbac.authorization.k8s.io/v1", "rolebindings", "kvfleet-modeldeployment-editor", ns)
    assert binding["subjects"][0]["name"] == "acme-devs"
    usage = wait_for("tenant usage", lambda: [g for g in (kube.get(API, "tenants", tenant).get("status") or {})
                                              .get("gpus", []) if g["flavor"] == flavors["h200"] and g["inUse"] == 4],
                     timeout=30)
    assert usage[0]["pending"] == 0

    # Self-healing: a deleted LocalQueue comes back; ModelDeployments carry no finalizer of ours.
    kube.delete(KUEUE, "localqueues", tenant, ns)
    wait_for("LocalQueue recreated", lambda: (q := kube.get(KUEUE, "localqueues", tenant, ns))
             and not q["metadata"].get("deletionTimestamp"), timeout=30)
    assert not kube.get(API, "modeldeployments", "chat", ns)["metadata"].get("finalizers")

    def refused(name: str, namespace: str, reason: str) -> dict[str, Any]:
        """Apply a Tenant asking for `namespace`; -> its condition with `reason`, once the operator sets it."""
        kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": name},
                    "spec": {"namespaces": [namespace], "quotas": [{"flavor": flavors["h200"], "nominal": 1}]}})
        tenants.names.append(name)
        return wait_for(f"{name} refused", lambda: [c for c in ((kube.get(API, "tenants", name) or {})
                                                                .get("status") or {}).get("conditions", [])
                                                    if c["reason"] == reason], timeout=30)[0]

    # A second tenant may not take the namespace over.
    rival = f"rival-{tenants.suffix}"
    cond = refused(rival, ns, "NamespaceConflict")
    assert ns in cond["message"] and tenant in cond["message"]
    assert kube.get("v1", "namespaces", ns)["metadata"]["labels"]["serving.kvfleet.dev/tenant"] == tenant
    assert kube.get(KUEUE, "localqueues", rival, ns) is None

    # Nor may a tenant have the operator's own namespace.
    squatter = f"squatter-{tenants.suffix}"
    cond = refused(squatter, SYSTEM_NAMESPACE, "ReservedNamespace")
    assert SYSTEM_NAMESPACE in cond["message"] and cond["status"] == "False"
    labels = ((kube.get("v1", "namespaces", SYSTEM_NAMESPACE) or {}).get("metadata") or {}).get("labels") or {}
    assert "serving.kvfleet.dev/tenant" not in labels
    assert kube.get(KUEUE, "localqueues", squatter, SYSTEM_NAMESPACE) is None

    # Events and the operator's own metrics.
    events = kube.list("v1", "events", ns)
    assert any(e["reason"] == "AllReplicasAdmitted" and e["involvedObject"]["name"] == "chat" for e in events)
    assert 'kvfleet_operator_reconciles_total{kind="ModelDeployment"}' in operator.metrics()
