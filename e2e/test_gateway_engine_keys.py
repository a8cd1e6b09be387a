"""Scenario: a ModelDeployment whose engines want their own key (`spec.apiKeySecretRef`), through the gateway.

The gateway runs as the chart's ServiceAccount (installed by Helm, the operator part off; the operator runs
locally, told that ServiceAccount as the chart tells it), whose RBAC reads Secrets of its key namespace only. The
model's engine pod runs a real `kvfleet serve` with the Secret's keys file. Checked: before the namespace grants
the gateway `get` on that one Secret, the ModelDeployment's GatewayKeyAccess condition is False with the grant to
run, and a request is a 502 that says what to grant (not the client's 401, and no engine is asked); after `kubectl
create role/rolebinding` the condition turns True and the `openai` client is served; when the Secret is rotated to
a new key (the engine reads it a kubelet sync later, the gateway a request later), every request is still answered;
no key is ever logged; revoking the RoleBinding turns the condition False again, and a ClusterRoleBinding's grant
True (cluster-wide RBAC changes give such models a pass too).
"""
from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.gateway.testing import GatewayProcess
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from chart_fixtures import gateway_release
from local_engines import base_url
from operator_fixtures import (
    API,
    SYSTEM_NAMESPACE,
    engine_pods,
    model_deployment,
    operator_log,
    service_account_kubeconfig,
)

pytestmark = pytest.mark.timeout(600)

MSG = [{"role": "user", "content": "Say something."}]
SFX = uuid.uuid4().hex[:5]
RELEASE, GW_NS = f"gwk-{SFX}", f"gwk-system-{SFX}"
GW_SA = f"{RELEASE}-kvfleet-gateway"  # the chart's gateway ServiceAccount


@pytest.fixture(scope="module")
def operator(crds: None, kubeconfig: str, cluster: Any) -> Iterator[OperatorProcess]:
    """The operator as the chart runs it beside its gateway: it reports whether that gateway may read a model's
    engine key (GatewayKeyAccess)."""
    proc = OperatorProcess(kubeconfig, operator_log(cluster, "test_gateway_engine_keys"), env={
        "KVFLEET_SYSTEM_NAMESPACES": SYSTEM_NAMESPACE, "KVFLEET_GATEWAY_SERVICE_ACCOUNT": f"{GW_NS}/{GW_SA}"}).start()
    yield proc
    proc.stop()


def key_condition(kube: Kube, ns: str) -> dict[str, Any]:
    status = (kube.get(API, "modeldeployments", "chat", ns) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "GatewayKeyAccess"), {})


def engine_status(pod: dict[str, Any], key: str) -> int:
    """What the engine itself answers `key` (its pod IP, no gateway)."""
    return httpx.get(f"{base_url(pod)}/v1/models", trust_env=False, timeout=10,
                     headers={"Authorization": f"Bearer {key}"}).status_code


def test_engines_with_their_own_key_are_reached_once_their_secret_is_granted_to_the_gateway(
        cluster: Any, kube: Kube, kubectl: Callable[..., Any], crds: None, tenants: Any, flavors: dict[str, str],
        operator: OperatorProcess, tmp_path: Path) -> None:  # fmt: skip
    sfx, gw_ns = SFX, GW_NS
    tenant_key, old, new = (f"{who}-{uuid.uuid4().hex}" for who in ("tenant", "engine-old", "engine-new"))
    with gateway_release(cluster, kube, tmp_path, RELEASE, gw_ns) as sa:
        assert sa == GW_SA  # the ServiceAccount the operator was told
        kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-keys", "namespace": gw_ns},
            "data": {"k1": base64.b64encode(tenant_key.encode()).decode()}}))
        _, ns = tenants.create("gwk", [{"flavor": flavors["h200"], "nominal": 1}],
                               gateway={"apiKeySecrets": [{"name": "team-keys"}]})
        kubectl("create", "secret", "generic", "chat-engine-keys", f"--from-literal=keys.yaml={old}: gateway",
                namespace=ns)
        kube.apply(model_deployment("chat", ns, flavors["h200"],
                                    apiKeySecretRef={"name": "chat-engine-keys", "key": "keys.yaml"}))
        wait_for("chat ready", lambda: ((kube.get(API, "modeldeployments", "chat", ns) or {}).get("status") or {})
                 .get("readyReplicas") == 1, timeout=300)
        # The operator tells the model's owner before any client meets the gateway's 502, with the grant to run.
        cond = wait_for("GatewayKeyAccess False",
                        lambda: (c := key_condition(kube, ns)).get("reason") == "KeyNotGranted" and c, timeout=60)
        assert cond["status"] == "False" and "--resource-name=chat-engine-keys" in cond["message"], cond
        assert f"--serviceaccount={gw_ns}:{sa}" in cond["message"], cond
        config = service_account_kubeconfig(cluster, kubectl, sa, gw_ns, tmp_path / "gw.kubeconfig")
        with GatewayProcess(Path(cluster.logs) / f"gateway-engine-keys-{sfx}.log", kubeconfig=config,
                            args=["--keys-namespace", gw_ns]) as gw:
            wait_for("the gateway sees the replica",
                     lambda: gw.metric("kvfleet_gateway_ready_replicas", namespace=ns) == 1, timeout=60)
            client = OpenAI(base_url=gw.url + "/v1", api_key=tenant_key, max_retries=0, timeout=60,
                            http_client=httpx.Client(trust_env=False))

            def chat() -> Any:
                return client.chat.completions.create(model="chat", messages=MSG, max_tokens=4)

            # Not granted: the gateway's RBAC does not reach the Secret. A 502 saying what to grant.
            with pytest.raises(openai.APIStatusError) as err:
                chat()
            body = err.value.body
            assert err.value.status_code == 502 and body["code"] == "upstream_auth_unavailable", body
            assert "forbidden" in body["message"] and "resourceNames [chat-engine-keys]" in body["message"], body

            # The namespace's admin grants `get` on that one Secret, and nothing else.
            kubectl("create", "role", "kvfleet-gateway-engine-key", "--verb=get", "--resource=secrets",
                    "--resource-name=chat-engine-keys", namespace=ns)
            kubectl("create", "rolebinding", "kvfleet-gateway-engine-key", "--role=kvfleet-gateway-engine-key",
                    f"--serviceaccount={gw_ns}:{sa}", namespace=ns)
            assert kubectl("auth", "can-i", "list", "secrets", "-n", ns, "--as", f"system:serviceaccount:{gw_ns}:{sa}",
                           check=False).stdout.strip() == "no"

            def served() -> Any:
                try:
                    return chat()
                except openai.APIStatusError as exc:  # the failed read is kept a few seconds
                    assert exc.body["code"] == "upstream_auth_unavailable", exc.body
                    return None

            reply = wait_for("served once granted", served, timeout=30)
            assert reply.usage.completion_tokens > 0
            # the RoleBinding's event gave the model a pass: the condition follows the grant
            wait_for("GatewayKeyAccess True", lambda: key_condition(kube, ns).get("status") == "True", timeout=60)

            # Rotation: the Secret now holds a new key only. The engine takes it a kubelet sync later; the
            # gateway sends the old key while it works, and on the engine's 401 reads the Secret again.
            (pod,) = engine_pods(kube, ns, "chat")
            kubectl("patch", "secret", "chat-engine-keys", "-p",
                    json.dumps({"stringData": {"keys.yaml": f"{new}: gateway"}}), namespace=ns)
            answered = []
            deadline = time.monotonic() + 60
            while engine_status(pod, old) != 401:  # the engine still takes the old key: so must the gateway
                assert time.monotonic() < deadline, "the engine never read the rotated Secret"
                answered.append(chat().usage.completion_tokens)
            for _ in range(3):  # the engine takes the new key only now
                answered.append(chat().usage.completion_tokens)
            # the gateway sent the key that worked until the engine refused it, then the Secret's new one
            assert gw.metric("kvfleet_gateway_upstream_retries_total", reason="upstream_key_refused") >= 1
            assert engine_status(pod, new) == 200 and all(n > 0 for n in answered), answered
            log = gw.log_tail(2000)
        assert tenant_key not in log and old not in log and new not in log
        assert "engine key unavailable" in log and "forbidden" in log

        # Revoked: the RoleBinding's deletion gives the model a pass too.
        kubectl("delete", "rolebinding", "kvfleet-gateway-engine-key", namespace=ns)
        wait_for("GatewayKeyAccess False once revoked",
                 lambda: key_condition(kube, ns).get("reason") == "KeyNotGranted", timeout=60)
        # A cluster-wide grant of the Secret's name: a ClusterRoleBinding's event gives every such model a pass.
        grant = f"kvfleet-gateway-engine-key-{sfx}"
        try:
            kubectl("create", "clusterrole", grant, "--verb=get", "--resource=secrets",
                    "--resource-name=chat-engine-keys")
            kubectl("create", "clusterrolebinding", grant, f"--clusterrole={grant}", f"--serviceaccount={gw_ns}:{sa}")
            wait_for("GatewayKeyAccess True by the cluster grant",
                     lambda: key_condition(kube, ns).get("reason") == "KeyGranted", timeout=60)
            assert any("rbac changed ns=all namespaces" in line and f"'{ns}/chat'" in line
                       for line in operator.log_text().splitlines())
        finally:
            kubectl("delete", "clusterrolebinding,clusterrole", grant, "--ignore-not-found", check=False)
