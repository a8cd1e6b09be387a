"""Fixtures shared by the operator's e2e scenarios (e2e/test_operator_*.py): the CRDs, the operator
running as a local process against the local cluster, unique ResourceFlavors and Tenants per test."""
from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, flavor_objects, install_crds, wait_for

from local_engines import use_test_model

API = "serving.kvfleet.dev/v1alpha1"
KUEUE = "kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def crds(kubectl: Callable[..., Any]) -> None:
    install_crds(kubectl)


@pytest.fixture(scope="module")
def kube(kubeconfig: str) -> Iterator[Kube]:
    client = Kube.from_kubeconfig(kubeconfig)
    yield client
    client.close()


SYSTEM_NAMESPACE = "kvfleet-system"


def operator_log(cluster: Any, name: str) -> Path:
    return Path(cluster.logs) / f"operator-{name}.log"


@pytest.fixture(scope="module")
def operator(crds: None, kubeconfig: str, cluster: Any, request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    """The operator (standalone) for one scenario module; its log is in .cluster/logs/."""
    name = Path(str(request.node.fspath)).stem
    # as the chart sets it: the operator's own namespace is the platform's (tenants may not list it)
    proc = OperatorProcess(kubeconfig, operator_log(cluster, name),
                           env={"KVFLEET_SYSTEM_NAMESPACES": SYSTEM_NAMESPACE}).start()
    yield proc
    proc.stop()


@pytest.fixture
def suffix() -> str:
    return uuid.uuid4().hex[:5]


@pytest.fixture
def flavors(cluster_objects: Any, suffix: str, crds: None) -> dict[str, str]:
    """ResourceFlavors h200-<suffix> and l40s-<suffix> selecting the cluster's GPU nodes."""
    out = {}
    for obj in flavor_objects(suffix):
        cluster_objects.create("kueue.x-k8s.io", "v1beta2", "resourceflavors", obj)
        out[obj["spec"]["nodeLabels"]["kvfleet.dev/gpu-flavor"]] = obj["metadata"]["name"]
    return out


class Tenants:
    """Creates Tenants with unique names; deletes their ModelDeployments, the Tenants and namespaces after."""

    def __init__(self, kube: Kube, suffix: str) -> None:
        self.kube = kube
        self.suffix = suffix
        self.names: list[str] = []
        self.namespaces: list[str] = []

    def create(self, base: str, quotas: list[dict[str, Any]], cohort: str | None = None,
               group: str | None = None, **extra: Any) -> tuple[str, str]:
        """A Tenant `<base>-<suffix>` with one namespace of the same name; returns (tenant, namespace)."""
        name = f"{base}-{self.suffix}"
        spec: dict[str, Any] = {"namespaces": [name], "quotas": quotas, **extra}
        if cohort:
            spec["cohort"] = f"{cohort}-{self.suffix}"
        if group:
            spec["group"] = group
        self.kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": name}, "spec": spec})
        self.names.append(name)
        self.namespaces.append(name)
        wait_for(f"LocalQueue of tenant {name}",
                 lambda: self.kube.get(KUEUE, "localqueues", name, name), timeout=60)
        use_test_model(self.kube, name)  # its engine pods run the tiny model (the namespace's annotation)
        return name, name

    def cleanup(self) -> None:
        for ns in self.namespaces:
            for mdep in self.kube.list(API, "modeldeployments", ns):
                self.kube.delete(API, "modeldeployments", mdep["metadata"]["name"], ns)
        for ns in self.namespaces:
            wait_for(f"ModelDeployments of {ns} gone", lambda ns=ns: not self.kube.list(API, "modeldeployments", ns),
                     timeout=60)
        for name in self.names:
            self.kube.delete(API, "tenants", name)
        for name in self.names:
            wait_for(f"ClusterQueue {name} gone", lambda name=name: self.kube.get(KUEUE, "clusterqueues", name) is None,
                     timeout=60)
        for ns in self.namespaces:
            self.kube.delete("v1", "namespaces", ns)


@pytest.fixture
def tenants(kube: Kube, suffix: str, flavors: dict[str, str], operator: OperatorProcess) -> Iterator[Tenants]:
    made = Tenants(kube, suffix)
    yield made
    made.cleanup()


def model_deployment(name: str, namespace: str, flavor: str, replicas: int = 1, tp: int = 1,
                     kind: str = "kvfleet", engine: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": name},
                 "engine": {"kind": kind, "tensorParallelSize": tp, **(engine or {})},
                 "resources": {"gpuFlavor": flavor, "cpu": "2", "memory": "8Gi"},
                 "replicas": replicas, **spec},
    }


def engine_pods(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """Pods of a ModelDeployment that exist and are not being deleted."""
    pods = kube.list("v1", "pods", namespace, f"serving.kvfleet.dev/modeldeployment={name}")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def deployments(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The ModelDeployment's Deployments (one per flavor and workload shape)."""
    return kube.list("apps/v1", "deployments", namespace, f"serving.kvfleet.dev/modeldeployment={name}")


def workloads(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return kube.list(KUEUE, "workloads", namespace, f"serving.kvfleet.dev/modeldeployment={name}")


def mdep_status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return (kube.get(API, "modeldeployments", name, namespace) or {}).get("status") or {}


# -- the Helm chart (e2e/test_operator_helm.py, e2e/test_gateway_chart.py) --

def helm(cluster: Any, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(cluster.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args],  # noqa: S603
                          capture_output=True, text=True, check=False, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {proc.stderr}")
    return proc


def service_account_kubeconfig(cluster: Any, kubectl: Callable[..., Any], sa: str, ns: str, path: Path) -> str:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a TokenRequest token)."""
    token = kubectl("create", "token", sa, "--namespace", ns, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
    }))
    return str(path)
