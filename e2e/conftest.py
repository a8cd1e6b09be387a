"""Fixtures for the e2e tests: a real local control plane (etcd, kube-apiserver, controller manager, scheduler,
kwok fake GPU nodes, Kueue) on loopback. See e2e/README.md.

Fixtures (names are the contract other e2e test files build on):
- ``cluster`` (session): the running cluster's ``Layout`` (``.kubeconfig``, ``.bin``, ``.logs``, ``.pod_cidr``);
  brings the cluster up when it is not running, reuses it when it is, and stops it at the end of the session only
  when this session started it and no other live session uses it (set ``KVFLEET_KEEP_CLUSTER=1`` to keep it).
- ``kubeconfig`` (session): path of the admin kubeconfig (str).
- ``k8s`` (session): a ``kubernetes.client.ApiClient`` for the admin user; make typed APIs from it
  (``kubernetes.client.CoreV1Api(k8s)``, ``AppsV1Api(k8s)``, ``CustomObjectsApi(k8s)``).
- ``namespace`` (function): a fresh namespace (name str) whose default ServiceAccount exists; deleted afterwards,
  with everything in it. Engine pods in it are served by the tiny model (``E2E_ENGINE_MODEL``).
- ``cluster_objects`` (function): ``ClusterObjects`` -- creates cluster-scoped custom objects (Kueue
  ResourceFlavors, ClusterQueues, ...) with ``create(group, version, plural, body)`` and deletes them afterwards.
- ``kubectl`` (session): ``kubectl(*args, namespace=None, stdin=None, check=True)`` runs the cluster's kubectl
  with the admin kubeconfig and returns the ``subprocess.CompletedProcess`` (text).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))

from local_engines import E2E_ENGINE_MODEL, MODEL_ANNOTATION  # noqa: E402
from localcluster import control, manifests, sharing  # noqa: E402
from localcluster.layout import Layout  # noqa: E402

# The operator scenarios' fixtures, for every e2e module (a module may override one, as some do `operator`).
from operator_fixtures import crds as crds  # noqa: E402
from operator_fixtures import flavors as flavors  # noqa: E402
from operator_fixtures import kube as kube  # noqa: E402
from operator_fixtures import operator as operator  # noqa: E402
from operator_fixtures import suffix as suffix  # noqa: E402
from operator_fixtures import tenants as tenants  # noqa: E402

E2E_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Layout]:
    """The local cluster, up and healthy (started here when it is not running)."""
    layout = Layout.for_checkout()
    missing = control.missing_binaries(layout)
    if missing:
        pytest.fail(f"cluster binaries missing ({', '.join(missing)}): run `make cluster-build` (or `make e2e`)")
    started = control.up(layout, os.environ.get("KVFLEET_CLUSTER_NODES", manifests.DEFAULT_NODES))
    layout = Layout.for_checkout()  # up may have moved to a free block of ports
    # Several test sessions may share one checkout's cluster: the last one out stops it, if a session started it.
    sharing.add_user(layout)
    yield layout
    last = sharing.release_user(layout)
    if started and last and os.environ.get("KVFLEET_KEEP_CLUSTER") != "1":
        control.down(layout)


@pytest.fixture(scope="session")
def kubeconfig(cluster: Layout) -> str:
    return str(cluster.kubeconfig)


@pytest.fixture(scope="session")
def k8s(kubeconfig: str) -> Iterator[Any]:
    from kubernetes import config

    client = config.new_client_from_config(config_file=kubeconfig)
    yield client
    client.close()


@pytest.fixture(scope="session")
def kubectl(cluster: Layout) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, namespace: str | None = None, stdin: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        argv = [str(cluster.binary("kubectl")), f"--kubeconfig={cluster.kubeconfig}"]
        argv += [f"--namespace={namespace}"] if namespace else []
        proc = subprocess.run([*argv, *args], input=stdin, capture_output=True, text=True, check=False)  # noqa: S603
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    return run


def _short_test_name(request: pytest.FixtureRequest) -> str:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower()).strip("-")
    return base.removeprefix("test-")[:40].strip("-")


@pytest.fixture
def namespace(k8s: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (with its content) afterwards."""
    from kubernetes import client

    core = client.CoreV1Api(k8s)
    name = f"e2e-{_short_test_name(request)}-{uuid.uuid4().hex[:5]}"
    core.create_namespace({"metadata": {"name": name, "labels": {"kvfleet.dev/e2e": "true"},
                                        "annotations": {MODEL_ANNOTATION: E2E_ENGINE_MODEL}}})
    # The ServiceAccount admission plugin rejects pods until the namespace's default account exists.
    deadline = time.monotonic() + 30
    while not core.list_namespaced_service_account(name, field_selector="metadata.name=default").items:
        if time.monotonic() > deadline:
            raise TimeoutError(f"namespace {name}: default ServiceAccount not created in 30 s")
        time.sleep(0.2)
    yield name
    core.delete_namespace(name, propagation_policy="Background")


class ClusterObjects:
    """Creates cluster-scoped custom objects for one test and deletes them afterwards (newest first)."""

    def __init__(self, k8s: Any) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(k8s)
        self.made: list[tuple[str, str, str, str]] = []

    def create(self, group: str, version: str, plural: str, body: dict[str, Any]) -> dict[str, Any]:
        made = self.api.create_cluster_custom_object(group, version, plural, body)
        self.made.append((group, version, plural, made["metadata"]["name"]))
        return made

    def delete_all(self) -> None:
        from kubernetes.client.exceptions import ApiException

        for group, version, plural, name in reversed(self.made):
            try:
                self.api.delete_cluster_custom_object(group, version, plural, name)
            except ApiException as err:
                if err.status != 404:
                    raise
        self.made.clear()


@pytest.fixture
def cluster_objects(k8s: Any) -> Iterator[ClusterObjects]:
    objects = ClusterObjects(k8s)
    yield objects
    objects.delete_all()
