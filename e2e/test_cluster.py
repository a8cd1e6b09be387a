"""The local control plane itself: real apiserver validation, real controllers and scheduler, kwok GPU nodes, and
Kueue admitting workloads against a GPU quota."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from localcluster import layout as layout_mod
from localcluster.manifests import DEFAULT_NODES, FLAVOR_LABEL, FLAVORS, GPU_RESOURCE, parse_node_spec

KUEUE = ("kueue.x-k8s.io", "v1beta2")


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Polls `check` until it returns something truthy, which is returned."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


def test_apiserver_reports_the_pinned_version(k8s: Any) -> None:
    info = client.VersionApi(k8s).get_code()
    assert info.git_version == layout_mod.versions()["K8S_VERSION"]


def test_gpu_nodes_are_ready_with_gpu_capacity(k8s: Any, cluster: Any) -> None:
    nodes = client.CoreV1Api(k8s).list_node(label_selector=FLAVOR_LABEL).items
    by_flavor: dict[str, list[Any]] = {}
    for node in nodes:
        by_flavor.setdefault(node.metadata.labels[FLAVOR_LABEL], []).append(node)
    requested = parse_node_spec(os.environ.get("KVFLEET_CLUSTER_NODES", DEFAULT_NODES))
    assert {f: len(n) for f, n in by_flavor.items()} == {flavor.name: count for flavor, count in requested}
    for flavor, flavor_nodes in by_flavor.items():
        for node in flavor_nodes:
            ready = next(c for c in node.status.conditions if c.type == "Ready")
            assert ready.status == "True", f"{node.metadata.name}: {ready.reason} {ready.message}"
            assert node.status.allocatable[GPU_RESOURCE] == str(FLAVORS[flavor].gpus)
            assert node.metadata.labels["nvidia.com/gpu.product"] == FLAVORS[flavor].product
            internal = next(a.address for a in node.status.addresses if a.type == "InternalIP")
            assert ipaddress.ip_address(internal).is_loopback
            assert not any(t.key == "node.kubernetes.io/not-ready" for t in node.spec.taints or [])


def test_deployment_asking_for_gpus_gets_running_pods_on_gpu_nodes(k8s: Any, namespace: str, cluster: Any) -> None:
    labels = {"app": "gpu-demo"}
    container = {
        "name": "engine",
        "image": "kvfleet/engine:test",
        "resources": {"limits": {GPU_RESOURCE: "1"}, "requests": {GPU_RESOURCE: "1", "cpu": "1"}},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-demo"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}},
        },
    }
    apps, core = client.AppsV1Api(k8s), client.CoreV1Api(k8s)
    apps.create_namespaced_deployment(namespace, deployment)

    def running_pods() -> list[Any]:
        pods = core.list_namespaced_pod(namespace, label_selector="app=gpu-demo").items
        running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        return running if len(running) == 2 else []

    pods = wait_for("2 Running pods", running_pods)
    pod_network = ipaddress.ip_network(cluster.pod_cidr)
    for pod in pods:
        node = core.read_node(pod.spec.node_name)
        assert FLAVOR_LABEL in node.metadata.labels
        assert ipaddress.ip_address(pod.status.pod_ip) in pod_network
    wait_for("deployment ready", lambda: apps.read_namespaced_deployment(namespace=namespace, name="gpu-demo")
             .status.ready_replicas == 2)  # fmt: skip


def _gpu_workload(name: str, queue: str, gpus: int) -> dict[str, Any]:
    pod_spec = {
        "restartPolicy": "Never",
        "containers": [{"name": "engine", "image": "kvfleet/engine:test",
                        "resources": {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}}],
    }  # fmt: skip
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": name},
        "spec": {"queueName": queue, "podSets": [{"name": "main", "count": 1, "template": {"spec": pod_spec}}]},
    }


def test_kueue_admits_within_gpu_quota_and_queues_the_rest(k8s: Any, namespace: str, cluster_objects: Any) -> None:
    api = client.CustomObjectsApi(k8s)
    flavor, queue = f"h200-{namespace}", f"gpus-{namespace}"
    cluster_objects.create(*KUEUE, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor},
        "spec": {"nodeLabels": {FLAVOR_LABEL: "h200"}},
    })  # fmt: skip
    cluster_objects.create(*KUEUE, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": queue},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [{"coveredResources": [GPU_RESOURCE], "flavors": [
                {"name": flavor, "resources": [{"name": GPU_RESOURCE, "nominalQuota": "4"}]}]}],
        },
    })  # fmt: skip
    api.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "gpus"},
        "spec": {"clusterQueue": queue},
    })  # fmt: skip
    wait_for("ClusterQueue active", lambda: (c := condition(api.get_cluster_custom_object(
        *KUEUE, "clusterqueues", queue), "Active")) and c["status"] == "True")  # fmt: skip

    def workload(name: str) -> dict[str, Any]:
        return api.get_namespaced_custom_object(*KUEUE, namespace, "workloads", name)

    def reserved(name: str) -> str | None:
        c = condition(workload(name), "QuotaReserved")
        return c["status"] if c else None

    api.create_namespaced_custom_object(*KUEUE, namespace, "workloads", _gpu_workload("first", "gpus", 4))
    wait_for("first admitted", lambda: (c := condition(workload("first"), "Admitted")) and c["status"] == "True")
    assignment = workload("first")["status"]["admission"]
    assert assignment["clusterQueue"] == queue
    assert assignment["podSetAssignments"][0]["flavors"] == {GPU_RESOURCE: flavor}

    api.create_namespaced_custom_object(*KUEUE, namespace, "workloads", _gpu_workload("second", "gpus", 4))
    wait_for("second evaluated", lambda: reserved("second") == "False")
    pending = condition(workload("second"), "QuotaReserved")
    assert pending["reason"] == "Pending" and "insufficient" in pending["message"].lower(), pending
    time.sleep(2)  # several scheduling cycles: the quota stays taken
    assert reserved("second") == "False"

    api.delete_namespaced_custom_object(*KUEUE, namespace, "workloads", "first")
    wait_for("second admitted after first deleted", lambda: reserved("second") == "True")


def test_kueue_converts_between_its_api_versions(k8s: Any, namespace: str, cluster_objects: Any) -> None:
    """The apiserver reaches Kueue's conversion webhook on loopback: v1beta1 reads of v1beta2 objects work."""
    api = client.CustomObjectsApi(k8s)
    name = f"conv-{namespace}"
    cluster_objects.create(*KUEUE, "clusterqueues", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {"cohortName": "research", "namespaceSelector": {}, "resourceGroups": []},
    })  # fmt: skip
    old = api.get_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "clusterqueues", name)
    assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert old["spec"]["cohort"] == "research" and "cohortName" not in old["spec"]


def test_apiserver_rejects_invalid_objects_with_its_own_validation(k8s: Any, namespace: str) -> None:
    bad_deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bad"},
        "spec": {"replicas": -1, "selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c", "image": "i"}]}}},
    }  # fmt: skip
    with pytest.raises(ApiException) as built_in:
        client.AppsV1Api(k8s).create_namespaced_deployment(namespace, bad_deployment)
    assert built_in.value.status == 422
    assert "spec.replicas" in built_in.value.body and "greater than or equal to 0" in built_in.value.body

    # A CRD's OpenAPI schema is enforced by the apiserver too (no webhook involved).
    bad_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "bad-queue"},
        "spec": {"clusterQueue": "q", "stopPolicy": "Sometimes"},
    }  # fmt: skip
    with pytest.raises(ApiException) as crd:
        client.CustomObjectsApi(k8s).create_namespaced_custom_object(*KUEUE, namespace, "localqueues", bad_queue)
    assert crd.value.status == 422
    assert "spec.stopPolicy" in crd.value.body and "Sometimes" in crd.value.body


# --- the cluster scripts' pure parts (no cluster needed) ------------------------------------------------------------


def test_node_spec_parsing_names_the_bad_field() -> None:
    assert [(f.name, n) for f, n in parse_node_spec("h200=1, l40s=3")] == [("h200", 1), ("l40s", 3)]
    for bad, message in [("a100=1", "FLAVOR one of"), ("h200=0", "1-50"), ("h200", "FLAVOR=COUNT"), ("", "at least")]:
        with pytest.raises(ValueError, match=message):
            parse_node_spec(bad)


def test_every_address_of_the_cluster_is_loopback_and_nodes_are_distinct() -> None:
    from localcluster.layout import Layout
    from localcluster.manifests import gpu_nodes

    layout = Layout.for_checkout()
    nodes = gpu_nodes("h200=2,l40s=2", layout.node_ip)
    ips = [a["address"] for n in nodes for a in n["status"]["addresses"] if a["type"] == "InternalIP"]
    assert len(set(ips)) == 4
    pods = ipaddress.ip_network(layout.pod_cidr)
    assert pods.subnet_of(ipaddress.ip_network("127.0.0.0/8"))
    assert all(ipaddress.ip_address(ip).is_loopback and ipaddress.ip_address(ip) not in pods for ip in ips)
    assert len({layout.port(p) for p in ("etcd_client", "apiserver", "kueue_webhook")}) == 3


def test_port_base_override_is_validated(tmp_path: Any) -> None:
    from localcluster.layout import Layout, port_base

    assert port_base(tmp_path, {"KVFLEET_CLUSTER_PORT_BASE": "31000"}) == 31000
    hashed = port_base(tmp_path, {})
    assert 20000 <= hashed < 29000 and hashed % 100 == 0
    (tmp_path / ".cluster").mkdir()
    (tmp_path / ".cluster" / "port-base").write_text("24500\n")  # what cluster-up writes after moving
    assert port_base(tmp_path, {}) == 24500
    assert Layout(tmp_path, 24500).pod_cidr == "127.145.0.0/17"  # the pod network moves with the ports
    with pytest.raises(ValueError, match="KVFLEET_CLUSTER_PORT_BASE"):
        port_base(tmp_path, {"KVFLEET_CLUSTER_PORT_BASE": "80"})


def test_only_kueues_converted_crds_get_the_conversion_stanza() -> None:
    from localcluster.manifests import with_conversion_webhook

    url = "https://127.0.0.1:20909/convert"
    workloads = {"metadata": {"name": "workloads.kueue.x-k8s.io"}, "spec": {"group": "kueue.x-k8s.io"}}
    flavors = {"metadata": {"name": "resourceflavors.kueue.x-k8s.io"}, "spec": {"group": "kueue.x-k8s.io"}}
    patched = with_conversion_webhook(workloads, url)
    assert patched["spec"]["conversion"]["webhook"]["clientConfig"] == {"url": url}
    assert "conversion" not in workloads["spec"]  # the input is left alone
    assert with_conversion_webhook(flavors, url) == flavors
