"""The Helm chart, as tests use it: helm with the cluster's kubeconfig, a render, the workloads' pod templates."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from kvfleet.operator.testing import REPO

CHART = REPO / "charts" / "kvfleet"
# Workload kinds and where their pod template sits.
POD_TEMPLATE_PATHS = {"Deployment": ("spec", "template"), "StatefulSet": ("spec", "template"),
                      "DaemonSet": ("spec", "template"), "ReplicaSet": ("spec", "template"),
                      "Job": ("spec", "template"), "CronJob": ("spec", "jobTemplate", "spec", "template"),
                      "Pod": ()}


def helm(cluster: Any, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(cluster.binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args],  # noqa: S603
                          capture_output=True, text=True, check=False, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {proc.stderr}")
    return proc


def render(cluster: Any, release: str, namespace: str, values: Path, *extra: str) -> list[dict[str, Any]]:
    """`helm template` of the chart: every document it renders."""
    out = helm(cluster, "template", release, str(CHART), "--namespace", namespace, "--kube-version", "v1.34.0",
               "-f", str(values), *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@contextmanager
def gateway_release(cluster: Any, kube: Any, tmp_path: Path, release: str, namespace: str) -> Iterator[str]:
    """The chart installed as `release` in `namespace` with its gateway only (the operator part off, no flavors):
    yields the gateway's ServiceAccount name; uninstalled and the namespace deleted on the way out."""
    values = tmp_path / f"{release}-values.yaml"
    # (the peering object is cluster-scoped: its own name, beside another release such as `make demo`'s)
    values.write_text(yaml.safe_dump({"operator": {"enabled": False, "peeringName": f"kvfleet-{release}"},
                                      "resourceFlavors": []}))
    try:
        helm(cluster, "install", release, str(CHART), "--namespace", namespace, "--create-namespace", "-f",
             str(values), "--wait", "--timeout", "90s")
        yield f"{release}-kvfleet-gateway"
    finally:
        helm(cluster, "uninstall", release, "--namespace", namespace, "--wait", "--timeout", "60s", check=False)
        kube.delete("v1", "namespaces", namespace)


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind/name, pod template) of every workload among `docs`."""
    for doc in docs:
        path = POD_TEMPLATE_PATHS.get(doc["kind"])
        if path is None:
            continue
        node: Any = doc
        for key in path:
            node = node[key]
        yield f"{doc['kind']}/{doc['metadata']['name']}", node
