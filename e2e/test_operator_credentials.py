"""The operator's credentials (kvfleet.operator.credentials, no Kubernetes client library) against the real API server:
a kubeconfig whose exec plugin hands out a ServiceAccount's token authenticates as that ServiceAccount, RBAC and all.
The admin's client certificate is what every other e2e test's operator logs in with."""
from __future__ import annotations

import base64
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.operator.kube import Kube, KubeError
from kvfleet.operator.testing import wait_for

PLUGIN = """#!{python}
import json, os
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": os.environ["SA_TOKEN"]}}}}))
"""


def test_exec_plugin_token_authenticates_as_its_service_account(cluster: Any, namespace: str, kubectl: Any,
                                                                 tmp_path: Path) -> None:
    kubectl("create", "serviceaccount", "reader", namespace=namespace)
    token = kubectl("create", "token", "reader", "--duration=10m", namespace=namespace).stdout.strip()
    plugin = tmp_path / "plugin"
    plugin.write_text(PLUGIN.format(python=sys.executable))
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = admin["clusters"][0]["cluster"]["server"]
    ca = base64.b64encode((Path(cluster.pki) / "ca.crt").read_bytes()).decode()
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "reader", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin),
            "env": [{"name": "SA_TOKEN", "value": token}], "interactiveMode": "Never"}}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "reader"}}]}))
    kube = Kube.from_kubeconfig(str(config))
    try:
        with pytest.raises(KubeError) as refused:   # authenticated (a 403, not a 401), not yet authorized
            kube.list("v1", "configmaps", namespace)
        assert refused.value.status == 403
        assert f"system:serviceaccount:{namespace}:reader" in str(refused.value)
        kubectl("create", "rolebinding", "reader-view", "--clusterrole=view", f"--serviceaccount={namespace}:reader",
                namespace=namespace)

        def listed() -> set[str] | None:   # the RBAC authorizer sees the binding through its informer
            try:
                return {c["metadata"]["name"] for c in kube.list("v1", "configmaps", namespace)}
            except KubeError as exc:
                assert exc.status == 403, exc
                return None

        assert "kube-root-ca.crt" in wait_for("the RoleBinding to take effect", listed, timeout=30)
    finally:
        kube.close()
