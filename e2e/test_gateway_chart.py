"""Scenario: the chart's gateway: a restricted pod, read-only RBAC with Secrets only in the key namespace, and
`kvfleet gateway` running as the chart's gateway ServiceAccount (a local process) with nothing forbidden."""
from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from kvfleet.gateway.testing import GatewayProcess
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import REPO, wait_for

from chart_fixtures import gateway_release
from operator_fixtures import helm, service_account_kubeconfig

CHART = REPO / "charts" / "kvfleet"


def render(cluster: Any, tmp_path: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    vals = tmp_path / "values.yaml"
    vals.write_text(yaml.safe_dump(values))
    out = helm(cluster, "template", "rel", str(CHART), "--namespace", "kvfleet-system", "--kube-version", "v1.34.0",
               "-f", str(vals)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_the_gateway_is_a_restricted_pod_with_read_only_rbac(cluster: Any, tmp_path: Path) -> None:
    docs = render(cluster, tmp_path, {"gateway": {"apiKeys": {"namespace": "kvfleet-keys"}}})
    dep = named(docs, "Deployment", "rel-kvfleet-gateway")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2 and spec["serviceAccountName"] == "rel-kvfleet-gateway"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    assert c["command"] == ["kvfleet", "gateway"] and "--keys-namespace=kvfleet-keys" in c["args"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
    svc = named(docs, "Service", "rel-kvfleet-gateway")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    pdb = named(docs, "PodDisruptionBudget", "rel-kvfleet-gateway")  # two replicas: a drain takes one at a time
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == \
        dep["spec"]["selector"]["matchLabels"]
    one = render(cluster, tmp_path, {"gateway": {"replicas": 1}})
    assert not [d for d in one if d["kind"] == "PodDisruptionBudget"]  # one replica: a budget would block drains
    role = named(docs, "ClusterRole", "rel-kvfleet-gateway")
    read = ["list", "watch"]
    assert role["rules"] == [
        {"apiGroups": ["serving.kvfleet.dev"], "resources": ["tenants"], "verbs": read},
        # patch: the gateway-demand annotation that wakes a model at zero, its one write
        {"apiGroups": ["serving.kvfleet.dev"], "resources": ["modeldeployments"], "verbs": [*read, "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": read}]
    keys = named(docs, "Role", "rel-kvfleet-gateway-keys")
    assert keys["metadata"]["namespace"] == "kvfleet-keys"
    assert keys["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": read}]
    policy = named(docs, "NetworkPolicy", "rel-kvfleet-gateway")
    metrics_rule = next(r for r in policy["spec"]["ingress"] if r["ports"] == [{"port": "metrics"}])
    assert [f["namespaceSelector"]["matchLabels"] for f in metrics_rule["from"]] == [
        {"kubernetes.io/metadata.name": "kvfleet-system"}]
    assert not any(d["metadata"]["name"].endswith("-gateway") for d in render(
        cluster, tmp_path, {"gateway": {"enabled": False}}))


def test_the_gateway_runs_as_the_charts_service_account(cluster: Any, kube: Kube, crds: None,
                                                         kubectl: Callable[..., Any], tmp_path: Path) -> None:
    sfx = uuid.uuid4().hex[:5]
    release, ns = f"gw-{sfx}", f"gw-system-{sfx}"
    with gateway_release(cluster, kube, tmp_path, release, ns) as gateway_sa:
        sa = f"system:serviceaccount:{ns}:{gateway_sa}"
        can = {(verb, res, where): kubectl("auth", "can-i", verb, res, "--as", sa, *where, check=False).stdout.strip()
               for verb, res, where in (("list", "secrets", ("-n", ns)), ("list", "secrets", ("-n", "default")),
                                        ("get", "secrets", ("-n", "default")), ("list", "pods", ("-A",)),
                                        ("watch", "tenants.serving.kvfleet.dev", ()),
                                        ("create", "pods", ("-n", ns)), ("patch", "tenants.serving.kvfleet.dev", ()),
                                        # the gateway-demand annotation (scale from zero), nothing more
                                        ("patch", "modeldeployments.serving.kvfleet.dev", ("-A",)),
                                        ("update", "modeldeployments.serving.kvfleet.dev", ("-A",)),
                                        ("delete", "modeldeployments.serving.kvfleet.dev", ("-A",)))}
        assert [v for v in can.values()] == ["yes", "no", "no", "yes", "yes", "no", "no", "yes", "no", "no"], can
        config = service_account_kubeconfig(cluster, kubectl, gateway_sa, ns,
                                            tmp_path / "gw.kubeconfig")
        with GatewayProcess(Path(cluster.logs) / f"gateway-chart-{sfx}.log", kubeconfig=config,
                            args=["--keys-namespace", ns]) as gw:  # ready = every watch listed under its RBAC
            wait_for("a metrics scrape", lambda: "kvfleet_gateway_unauthenticated" in gw.metrics(), timeout=10)
        log = gw.log_path.read_text()
        # a 403 as the gateway writes a refused call (`KubeError`: "HTTP 403: <the API server's Status>") or as the
        # Status itself; not any 403 (a port such as 58403, a timestamp's milliseconds such as 01:10:48,403)
        refused = re.search(r"HTTP 403\b|\"code\": ?403\b|\b403 Forbidden", log)
        assert not refused and "forbidden" not in log.lower(), log[-2000:]


def test_kubectl_explain_describes_the_tenants_gateway_keys(crds: None, kubectl: Callable[..., Any]) -> None:
    out = wait_for("the Tenant schema published", lambda: (p := kubectl(
        "explain", "tenants.spec.gateway.apiKeySecrets", check=False)).returncode == 0 and p.stdout, timeout=30)
    assert "Authorization: Bearer" in out and "name" in out and "gateway's key namespace" in out
