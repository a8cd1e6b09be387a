"""Scenario: each invalid spec is rejected by the apiserver at `kubectl apply` with a message naming the
field; what only the operator can see (an unknown flavor) becomes a condition and an Event."""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, mdep_status, model_deployment

BASE = {"model": {"source": "org/model"}}


@pytest.mark.parametrize("spec, field", [
    ({**BASE, "replicas": -1}, "spec.replicas"),
    ({**BASE, "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({**BASE, "engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization"),
    ({**BASE, "engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({**BASE, "engine": {"kind": "tgi"}}, "spec.engine.kind"),
    ({**BASE, "resources": {"gpuFlavor": "H200_fast"}}, "spec.resources.gpuFlavor"),
    ({**BASE, "engine": {"tensorParallelSize": 0}}, "spec.engine.tensorParallelSize"),
    ({"model": {"source": "s3://bucket/model"}}, "spec.model.source"),
    ({"model": {}}, "spec.model.source"),
    ({"model": {"source": "org/has space"}}, "spec.model.source"),
    ({**BASE, "resources": {"cpu": -1}}, "spec.resources.cpu"),
    ({**BASE, "resources": {"memory": "0"}}, "spec.resources.memory"),
    ({**BASE, "_name": "1chat"}, "metadata.name"),
    ({**BASE, "_name": "m" * 64}, "metadata.name"),
    ({**BASE, "engine": {"extraArgs": ["--enforce-eager", "--port", "9000"]}}, "spec.engine.extraArgs"),
    ({**BASE, "engine": {"extraArgs": ["--tensor-parallel-size=8"]}}, "spec.engine.extraArgs"),
], ids=["negative-replicas", "min-gt-max", "gmu-zero", "gmu-above-one", "engine-kind", "flavor-name", "tp-zero",
        "source-scheme", "source-missing", "source-not-hub-id", "negative-cpu", "zero-memory", "name-not-dns1035",
        "name-too-long", "owned-flag-port", "owned-flag-tp"])
def test_invalid_model_deployment_rejected(crds: None, kubectl: Callable[..., Any], spec: dict, field: str) -> None:
    spec = dict(spec)
    name = spec.pop("_name", "bad")  # the name becomes the Service's name
    body = {"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}
    proc = kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(body), check=False)
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr, proc.stderr
    if field == "spec.engine.extraArgs":   # the message names the flag (messageExpression)
        flag = "--port" if "--port" in spec["engine"]["extraArgs"] else "--tensor-parallel-size=8"
        assert f"{flag} is set by kvfleet from the spec" in proc.stderr, proc.stderr


@pytest.mark.parametrize("spec, field", [
    ({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 2, "borrowingLimit": 1}]}, "borrowingLimit"),
    ({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1, "lendingLimit": 2}]},
     "spec.quotas[0].lendingLimit"),
    ({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": -1}]}, "spec.quotas[0].nominal"),
    ({"namespaces": [], "quotas": [{"flavor": "h200", "nominal": 1}]}, "spec.namespaces"),
    ({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1}, {"flavor": "h200", "nominal": 2}]},
     "spec.quotas[1]"),
    ({"namespaces": ["a", "kube-system"], "quotas": [{"flavor": "h200", "nominal": 1}]}, "spec.namespaces"),
    ({"namespaces": ["a"], "fairSharingWeight": -1, "quotas": [{"flavor": "h200", "nominal": 1}]},
     "spec.fairSharingWeight"),
    ({"namespaces": ["a"], "quotas": [{"flavor": "h200", "nominal": 1, "cpu": -4}]}, "spec.quotas[0].cpu"),
], ids=["borrow-without-cohort", "lend-above-nominal", "negative-nominal", "no-namespaces", "duplicate-flavor",
        "kube-namespace", "negative-weight", "negative-cpu-quota"])
def test_invalid_tenant_rejected(crds: None, kubectl: Callable[..., Any], spec: dict, field: str) -> None:
    body = {"apiVersion": API, "kind": "Tenant", "metadata": {"name": "bad"}, "spec": spec}
    proc = kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(body), check=False)
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr, proc.stderr


def test_unknown_flavor_is_a_condition_and_event(kube: Kube, tenants: Any, flavors: dict[str, str],
                                                 operator: OperatorProcess, cluster_objects: Any) -> None:
    late = f"late-{tenants.suffix}"
    _, ns = tenants.create("val", [{"flavor": flavors["h200"], "nominal": 2}, {"flavor": late, "nominal": 2}])
    kube.apply(model_deployment("ghost", ns, late))
    st = wait_for("FlavorNotFound", lambda: (s := mdep_status(kube, ns, "ghost")) and any(
        c["type"] == "Admitted" and c["reason"] == "FlavorNotFound" for c in s.get("conditions", [])) and s,
        timeout=60)
    msg = next(c["message"] for c in st["conditions"] if c["type"] == "Admitted")
    assert "spec.resources.gpuFlavor" in msg and late in msg
    assert st["admittedReplicas"] == 0
    assert not kube.list("kueue.x-k8s.io/v1beta2", "workloads", ns)
    events = wait_for("Warning event", lambda: [e for e in kube.list("v1", "events", ns)
                                                if e["reason"] == "FlavorNotFound"], timeout=30)
    assert events[0]["type"] == "Warning"
    # Once the flavor exists, the operator's retry admits the model without any change to it.
    cluster_objects.create("kueue.x-k8s.io", "v1beta2", "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": late},
        "spec": {"nodeLabels": {"kvfleet.dev/gpu-flavor": "l40s"}}})
    wait_for("admitted on the late flavor", lambda: mdep_status(kube, ns, "ghost").get("readyReplicas") == 1,
             timeout=60)


def test_host_path_outside_the_node_cache_is_a_condition_and_event(kube: Kube, tenants: Any,
                                                                    flavors: dict[str, str],
                                                                    operator: OperatorProcess) -> None:
    """A `file://` source becomes a hostPath: outside the node cache roots nothing runs (the node's files)."""
    _, ns = tenants.create("hostpath", [{"flavor": flavors["h200"], "nominal": 2}])
    body = model_deployment("peek", ns, flavors["h200"])
    body["spec"]["model"]["source"] = "file:///var/lib/kubelet/pods"
    kube.apply(body)
    st = wait_for("HostPathNotAllowed", lambda: (s := mdep_status(kube, ns, "peek")) and any(
        c["type"] == "Admitted" and c["reason"] == "HostPathNotAllowed" for c in s.get("conditions", [])) and s,
        timeout=60)
    msg = next(c["message"] for c in st["conditions"] if c["type"] == "Admitted")
    assert "spec.model.source" in msg and "/var/cache/kvfleet" in msg
    assert not kube.list("kueue.x-k8s.io/v1beta2", "workloads", ns)
    assert not kube.list("apps/v1", "deployments", ns)
    events = wait_for("Warning event", lambda: [e for e in kube.list("v1", "events", ns)
                                                if e["reason"] == "HostPathNotAllowed"], timeout=30)
    assert events[0]["type"] == "Warning"


@pytest.mark.parametrize("spec", [
    {**BASE, "replicas": 0},
    {**BASE, "engine": {"gpuMemoryUtilization": 1}},
    {**BASE, "resources": {"cpu": 2, "memory": "8Gi"}},
    {"model": {"source": "pvc://models/llama/8b"}, "engine": {"kind": "vllm", "tensorParallelSize": 8}},
    {"model": {"source": "file:///var/cache/kvfleet/x"}, "autoscaling": {"enabled": True, "minReplicas": 0,
                                                                       "maxReplicas": 4}},
], ids=["zero-replicas", "gmu-one", "int-cpu", "pvc-vllm-tp8", "file-autoscale"])
def test_valid_edge_specs_accepted(crds: None, kubectl: Callable[..., Any], spec: dict) -> None:
    body = {"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": "ok", "namespace": "default"},
            "spec": spec}
    proc = kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(body), check=False)
    assert proc.returncode == 0, proc.stderr
    applied = json.loads(proc.stdout)["spec"]
    assert applied["engine"]["kind"] in ("kvfleet", "vllm") and applied["resources"]["shmSize"] == "8Gi"


def test_sample_manifests_are_valid(crds: None, kubectl: Callable[..., Any]) -> None:
    """Every object of manifests/ passes the apiserver's validation (namespaced ones tried in `default`)."""
    import yaml

    from kvfleet.operator.testing import REPO

    docs = [d for f in sorted((REPO / "manifests").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert {d["kind"] for d in docs} >= {"Tenant", "ModelDeployment", "ResourceFlavor"}
    assert {d["spec"]["engine"]["kind"] for d in docs if d["kind"] == "ModelDeployment"} == {"kvfleet", "vllm"}
    for doc in docs:
        if doc["metadata"].get("namespace"):
            doc["metadata"]["namespace"] = "default"
        proc = kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(doc), check=False)
        assert proc.returncode == 0, f"{doc['kind']}/{doc['metadata']['name']}: {proc.stderr}"
