"""PodSecurity admission (the apiserver's own, on by default) against every pod kvfleet makes: the chart's workloads
in a namespace that enforces `restricted`, and the operator's engine pods in tenant namespaces, which the operator
labels `restricted`. A privileged pod in a tenant namespace is refused. Also: every manifest the chart renders is
accepted by the apiserver (`kubectl apply --dry-run=server`), and `kubectl explain` describes every CRD field."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import condition, wait_for

from chart_fixtures import CHART, helm, pod_templates, render
from operator_fixtures import API, engine_pods, mdep_status, model_deployment

PSS = "pod-security.kubernetes.io/"
VIOLATION = 'violates PodSecurity "restricted:latest"'


def restricted_namespace(client: Kube, name: str) -> None:
    client.apply({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "labels": {f"{PSS}enforce": "restricted", f"{PSS}enforce-version": "latest",
                                                      f"{PSS}warn": "restricted", f"{PSS}warn-version": "latest"}}})


def as_pod(name: str, namespace: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": template["metadata"].get("labels") or {}},
            "spec": template["spec"]}


def assert_read_only_roots(what: str, template: dict[str, Any]) -> None:
    """Not part of the restricted standard, but ours: every container's root file system is read-only, and what
    it writes goes to an emptyDir."""
    spec = template["spec"]
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        assert (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is True, f"{what}: {c['name']}"
        mounts = {m["mountPath"] for m in c.get("volumeMounts") or ()}
        assert "/tmp" in mounts, f"{what}: {c['name']} has no writable /tmp"


def dry_run_pod(kubectl: Callable[..., Any], pod: dict[str, Any]) -> Any:
    """Ask the apiserver to admit `pod` without creating it (admission plugins, PodSecurity included, run)."""
    return kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)


def chart_values(sfx: str) -> dict[str, Any]:
    return {"operator": {"peeringName": f"kvfleet-pss-{sfx}"},
            "resourceFlavors": [{"name": f"h200-pss-{sfx}", "nodeLabels": {"kvfleet.dev/gpu-flavor": "h200"}}],
            "tenants": [{"name": f"pss-{sfx}", "namespaces": [f"pss-{sfx}"], "cohort": "c",
                         "quotas": [{"flavor": f"h200-pss-{sfx}", "nominal": 2, "borrowingLimit": 1}]}]}


def test_chart_manifests_are_accepted_and_its_pods_are_restricted(cluster: Any, kube: Kube, crds: None,
                                                                  kubectl: Callable[..., Any],
                                                                  tmp_path: Path) -> None:
    sfx = uuid.uuid4().hex[:5]
    release = ns = f"kvfleet-pss-{sfx}"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(chart_values(sfx)))
    restricted_namespace(kube, ns)
    try:
        docs = render(cluster, release, ns, values, "--include-crds")
        assert {"CustomResourceDefinition", "Deployment", "Tenant", "ResourceFlavor"} <= {d["kind"] for d in docs}
        dry = kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(docs), check=False)
        assert dry.returncode == 0, dry.stderr
        assert "PodSecurity" not in dry.stderr, dry.stderr  # the namespace warns at restricted, too
        # For real: the chart installs, and the pods its workloads create are admitted (and made Ready by kwok).
        helm(cluster, "install", release, str(CHART), "--namespace", ns, "-f", str(values), "--wait",
             "--timeout", "90s")
        templates = dict(pod_templates(docs))
        assert any(k.startswith("Deployment/") for k in templates), templates.keys()
        # Every pod template as a pod, whatever the workload kind (the gateway's too, once the chart has it).
        for what, template in templates.items():
            proc = dry_run_pod(kubectl, as_pod(f"probe-{uuid.uuid4().hex[:6]}", ns, template))
            assert proc.returncode == 0 and "PodSecurity" not in proc.stderr, f"{what}: {proc.stderr}"
            assert_read_only_roots(what, template)
        for workload in (d for d in docs if d["kind"] == "Deployment"):
            name, want = workload["metadata"]["name"], workload["spec"]["replicas"]
            dep = wait_for(f"{name} available", lambda name=name, want=want: (
                d := kube.get("apps/v1", "deployments", name, ns)) and (d.get("status") or {}).get(
                "availableReplicas") == want and d, timeout=60)
            assert dep["status"]["replicas"] == want
        pods = kube.list("v1", "pods", ns)
        assert pods and all(p["status"].get("phase") == "Running" for p in pods)
        refused = [e for e in kube.list("v1", "events", ns) if e.get("reason") == "FailedCreate"]
        assert not refused, [e["message"] for e in refused]
    finally:
        helm(cluster, "uninstall", release, "--namespace", ns, "--wait", "--timeout", "60s", check=False)
        kube.delete("v1", "namespaces", ns)
        kube.delete("v1", "namespaces", f"pss-{sfx}")


def privileged_pod(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "root-shell", "namespace": namespace},
            "spec": {"containers": [{"name": "sh", "image": "busybox", "securityContext": {"privileged": True}}]}}


def test_tenant_namespaces_enforce_restricted_and_admit_the_engine_pods(kube: Kube, tenants: Any,
                                                                       flavors: dict[str, str],
                                                                       kubectl: Callable[..., Any]) -> None:
    _, ns = tenants.create("pss", [{"flavor": flavors["h200"], "nominal": 4}])
    labels = kube.get("v1", "namespaces", ns)["metadata"]["labels"]
    assert labels[f"{PSS}enforce"] == "restricted" and labels[f"{PSS}enforce-version"] == "latest"
    kube.apply(model_deployment("chat", ns, flavors["h200"], replicas=2))
    kube.apply(model_deployment("vllm", ns, flavors["h200"], kind="vllm"))
    # Created, so admitted by PodSecurity's restricted level (and scheduled); whether their engines come up is
    # the engine kubelet's business (test_engine_pods).
    for name, n in (("chat", 2), ("vllm", 1)):
        wait_for(f"{name}: {n} admitted and scheduled", lambda name=name, n=n: mdep_status(kube, ns, name).get(
            "admittedReplicas") == n and len([p for p in engine_pods(kube, ns, name)
                                               if p["spec"].get("nodeName")]) == n, timeout=120)
    refused = [e for e in kube.list("v1", "events", ns) if e.get("reason") == "FailedCreate"]
    assert not refused, [e["message"] for e in refused]
    for dep in kube.list("apps/v1", "deployments", ns):
        proc = dry_run_pod(kubectl, as_pod(f"probe-{uuid.uuid4().hex[:6]}", ns, dep["spec"]["template"]))
        assert proc.returncode == 0 and "PodSecurity" not in proc.stderr, proc.stderr
        assert_read_only_roots(dep["metadata"]["name"], dep["spec"]["template"])
    # What restricted forbids is refused in a tenant namespace: a privileged pod, and a root one.
    proc = kubectl("create", "-f", "-", stdin=json.dumps(privileged_pod(ns)), check=False)
    assert proc.returncode != 0 and VIOLATION in proc.stderr and "privileged" in proc.stderr, proc.stderr
    rooted = privileged_pod(ns)
    rooted["spec"]["containers"][0]["securityContext"] = {"runAsUser": 0}
    proc = kubectl("create", "-f", "-", stdin=json.dumps(rooted), check=False)
    assert proc.returncode != 0 and VIOLATION in proc.stderr and "runAsNonRoot" in proc.stderr, proc.stderr
    assert kube.get("v1", "pods", "root-shell", ns) is None


def test_file_source_in_a_restricted_tenant_is_a_condition(kube: Kube, tenants: Any,
                                                           flavors: dict[str, str]) -> None:
    """A hostPath (file://) engine pod would never be admitted under restricted: a Condition says so instead."""
    _, ns = tenants.create("pss-file", [{"flavor": flavors["h200"], "nominal": 2}])
    body = model_deployment("local", ns, flavors["h200"])
    body["spec"]["model"]["source"] = "file:///var/cache/kvfleet/models/m"
    kube.apply(body)
    admitted = wait_for("HostPathNotAllowed", lambda: (c := condition(
        kube.get(API, "modeldeployments", "local", ns), "Admitted")) and c["reason"] == "HostPathNotAllowed" and c,
        timeout=60)
    assert "restricted Pod Security Standard" in admitted["message"] and "pvc://" in admitted["message"]
    assert not engine_pods(kube, ns, "local") and not kube.list("apps/v1", "deployments", ns)


@pytest.mark.parametrize("plural", ["modeldeployments", "tenants"])
def test_kubectl_explain_describes_every_field(crds: None, kubectl: Callable[..., Any], plural: str) -> None:
    """What `kubectl explain` shows is the apiserver's published OpenAPI v3: every field of ours has a description."""
    doc = json.loads(kubectl("get", "--raw", "/openapi/v3/apis/serving.kvfleet.dev/v1alpha1").stdout)
    kind = {"modeldeployments": "ModelDeployment", "tenants": "Tenant"}[plural]
    schemas = doc["components"]["schemas"]
    root = schemas[f"dev.kvfleet.serving.v1alpha1.{kind}"]
    missing: list[str] = []

    def walk(schema: dict[str, Any], path: str) -> None:
        for name, prop in (schema.get("properties") or {}).items():
            if "allOf" in prop or "$ref" in prop:  # metadata: the apiserver's ObjectMeta, described by it
                continue
            if not prop.get("description"):
                missing.append(f"{path}.{name}")
            walk(prop, f"{path}.{name}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{path}[]")

    walk(root, plural)
    assert root.get("description") and not missing, missing
    text = kubectl("explain", f"{plural}.spec").stdout
    assert "<empty>" not in text and "no description" not in text.lower(), text
