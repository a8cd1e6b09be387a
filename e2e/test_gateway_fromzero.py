"""Scenario: models that sleep at zero and wake on demand within Kueue quota, and per-tenant limits, at the gateway.

The local cluster's engine kubelet runs a real `kvfleet serve` (CPU, tiny model) for every engine pod; the operator
(autoscaler timer every few seconds, loopback only) and the gateway (a local process) watch the API server. Checked:

- a ModelDeployment with `autoscaling.minReplicas: 0` at zero: a request is held at the gateway, the gateway's
  demand annotation makes the autoscaler ask for one replica, Kueue admits it, the engine starts, and the held
  streaming request gets its first token (the latency from zero is printed and written to the cluster's logs);
  after `scaleDownDelaySeconds` without demand the model goes back to zero pods;
- the same at zero in a tenant with no GPU quota: the held request gets 429 with `Retry-After` and Kueue's reason,
  and no pod ever starts (quota is never bypassed);
- limits declared on Tenants (requests/min, tokens/min, concurrent requests) refuse at the declared numbers with
  429, `Retry-After` and a message naming the limit, counted in the gateway's metrics; with two gateway replicas
  reading each other's usage, a tenant's requests per minute hold across both (limits are shared, not per replica).
"""
from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet.gateway.testing import GatewayProcess
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import OperatorProcess, wait_for

from operator_fixtures import API, engine_pods, mdep_status, model_deployment

pytestmark = pytest.mark.timeout(600)

INTERVAL_S = 5  # the autoscaler's timer; waking does not wait for it (the demand annotation triggers a tick)
DELAY_S = 10  # scaleDownDelaySeconds
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def operator(crds: None, kubeconfig: str, cluster: Any, request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    env = {"KVFLEET_AUTOSCALE_INTERVAL": str(INTERVAL_S), "KVFLEET_LOOPBACK_ONLY": "1"}
    proc = OperatorProcess(kubeconfig, Path(cluster.logs) / f"operator-{request.node.name}.log", env=env).start()
    yield proc
    proc.stop()


@dataclass(frozen=True)
class KeyNamespace:
    """The gateway's key namespace; `write` puts a fresh key in a Secret there and returns it."""

    name: str
    kubectl: Callable[..., Any]

    def write(self, secret_name: str) -> str:
        key = f"{secret_name}-{uuid.uuid4().hex}"
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": secret_name, "namespace": self.name},
                  "data": {"k": base64.b64encode(key.encode()).decode()}}
        self.kubectl("apply", "-f", "-", stdin=json.dumps(secret))
        return key


@pytest.fixture
def keys_ns(kube: Kube, kubectl: Callable[..., Any]) -> Iterator[KeyNamespace]:
    ns = f"fz-keys-{uuid.uuid4().hex[:5]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield KeyNamespace(ns, kubectl)
    kube.delete("v1", "namespaces", ns)


def start_gateway(cluster: Any, kubeconfig: str, keys_ns: KeyNamespace, name: str, *extra: str) -> GatewayProcess:
    log = Path(cluster.logs) / f"gateway-{name}.log"
    args = ["--keys-namespace", keys_ns.name, "--scrape-interval", "0.5", "--admission-timeout", "90", *extra]
    return GatewayProcess(log, kubeconfig=kubeconfig, args=args).start()


def chat(gw: GatewayProcess, key: str, model: str = "chat", timeout: float = 300, **extra: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": MSG, "max_tokens": 8, **extra}, timeout=timeout,
                      trust_env=False)


def at_zero(kube: Kube, ns: str, name: str = "chat") -> bool:
    status = mdep_status(kube, ns, name)
    return status.get("desiredReplicas") == 0 and not engine_pods(kube, ns, name)


def autoscaled(ns: str, flavor: str, **engine: Any) -> dict[str, Any]:
    return model_deployment("chat", ns, flavor, replicas=0, engine=engine or None,
                            autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1, "targetQueueDepth": 4,
                                         "scaleDownDelaySeconds": DELAY_S})


def model_at_zero_behind_a_gateway(kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any, kubeconfig: str,
                                   keys_ns: KeyNamespace, *, tenant: str, keys: str, gpus: int,
                                   label: str) -> tuple[str, str, GatewayProcess]:
    """A tenant with `gpus` H200s of quota and a key, its autoscaled ModelDeployment at zero, and a gateway that lists
    the model: -> (key, namespace, gateway); the caller stops the gateway."""
    key = keys_ns.write(keys)
    _, ns = tenants.create(tenant, [{"flavor": flavors["h200"], "nominal": gpus}],
                           gateway={"apiKeySecrets": [{"name": keys}]})
    kube.apply(autoscaled(ns, flavors["h200"]))
    wait_for("the model at zero", lambda: at_zero(kube, ns), timeout=60)
    gw = start_gateway(cluster, kubeconfig, keys_ns, label)
    try:
        wait_for("the gateway lists the model", lambda: httpx.get(
            f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, trust_env=False).json().get("data"),
            timeout=60)
    except BaseException:
        gw.stop()
        raise
    return key, ns, gw


def test_wakes_from_zero_and_goes_back(kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any,
                                       kubeconfig: str, keys_ns: KeyNamespace) -> None:
    key, ns, gw = model_at_zero_behind_a_gateway(kube, tenants, flavors, cluster, kubeconfig, keys_ns,
                                                 tenant="fz-wake", keys="fz-keys", gpus=1, label="wake")
    try:
        marks: dict[str, float] = {}
        stop = threading.Event()

        def watch_status() -> None:  # when each step of the wake happened, for the report
            while not stop.is_set() and len(marks) < 3:
                status = mdep_status(kube, ns, "chat")
                for key, field in (("desired", "desiredReplicas"), ("admitted", "admittedReplicas"),
                                   ("ready", "readyReplicas")):
                    if key not in marks and (status.get(field) or 0) >= 1:
                        marks[key] = round(time.monotonic() - start, 2)
                stop.wait(0.2)

        start = time.monotonic()
        watcher = threading.Thread(target=watch_status, daemon=True)
        watcher.start()
        first_token = None
        text = ""
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "chat", "messages": MSG, "max_tokens": 8, "stream": True}, timeout=300,
                          trust_env=False) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if delta and first_token is None:
                    first_token = time.monotonic() - start
                text += delta
        assert first_token is not None and text
        stop.set()
        watcher.join(5)
        # the gateway sends the request on once the pod is Ready; the operator's status follows on its next
        # reconcile, so wait for it (bounded) rather than read it at once
        status = wait_for("the status to count the woken replica", lambda: (
            st if (st := mdep_status(kube, ns, "chat")).get("readyReplicas") == 1 else None), timeout=60)
        assert status["readyReplicas"] == 1 and status["admittedReplicas"] == 1
        ann = kube.get(API, "modeldeployments", "chat", ns)["metadata"]["annotations"]
        assert "gateway.kvfleet.dev/demand" in ann
        assert gw.metric("kvfleet_gateway_queue_outcomes_total", namespace=ns, outcome="dispatched") == 1
        report = {"first_token_from_zero_s": round(first_token, 2), "seconds_after_the_request": marks,
                  "note": "2 shared CPU cores, tiny model; noisy"}
        (Path(cluster.logs) / "fromzero-wake.json").write_text(json.dumps(report))
        print(f"\nfirst token from zero: {first_token:.2f}s; status reached 1 replica at {marks}")
        # warm now: a second request goes straight through
        assert chat(gw, key).status_code == 200
        # back to zero after the delay without demand
        wait_for("the model back at zero", lambda: at_zero(kube, ns), timeout=DELAY_S + 60 + 30)
        # the gateway follows the cluster through its watches: the pod's deletion reaches it a moment after the
        # API server says so, so wait for it (bounded) rather than read it at once
        wait_for("the gateway to drop the replica",
                 lambda: gw.metric("kvfleet_gateway_ready_replicas", namespace=ns) == 0, timeout=60)
    finally:
        gw.stop()


def test_quota_refusal_from_zero(kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any, kubeconfig: str,
                                 keys_ns: KeyNamespace) -> None:
    key, ns, gw = model_at_zero_behind_a_gateway(kube, tenants, flavors, cluster, kubeconfig, keys_ns,
                                                 tenant="fz-noq", keys="fz-nokeys", gpus=0, label="quota")
    try:
        start = time.monotonic()
        resp = chat(gw, key, timeout=120)
        waited = time.monotonic() - start
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        error = resp.json()["error"]
        assert error["code"] == "quota_exceeded"
        quota = next(c for c in mdep_status(kube, ns, "chat")["conditions"] if c["type"] == "QuotaExceeded")
        assert quota["status"] == "True" and quota["message"] in error["message"], (quota, error)
        assert "quota" in error["message"].lower()
        print(f"\n429 after {waited:.1f}s, Retry-After {resp.headers['Retry-After']}: {error['message']}")
        assert waited < 90  # answered on Kueue's verdict, not at the admission timeout
        assert not engine_pods(kube, ns, "chat")  # never a bypass of quota
        assert mdep_status(kube, ns, "chat").get("admittedReplicas", 0) == 0
    finally:
        gw.stop()


def test_limits_refuse_at_the_declared_numbers(kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any,
                                               kubeconfig: str, keys_ns: KeyNamespace) -> None:
    keys = {n: keys_ns.write(f"fz-{n}") for n in ("rpm", "tpm", "conc")}
    limits = {"rpm": {"requestsPerMinute": 3}, "tpm": {"tokensPerMinute": 40}, "conc": {"maxConcurrentRequests": 1}}
    names = {}
    quota = [{"flavor": flavors["h200"], "nominal": 1}]
    for n in ("rpm", "tpm", "conc"):
        names[n], _ = tenants.create(f"fz-{n}", quota if n == "rpm" else [{"flavor": flavors["h200"], "nominal": 0}],
                                     gateway={"apiKeySecrets": [{"name": f"fz-{n}"}], "limits": limits[n]})
    ns = names["rpm"]
    kube.apply(model_deployment("chat", ns, flavors["h200"], replicas=1,
                                gateway={"sharedWith": [names["tpm"], names["conc"]]}))
    wait_for("chat ready", lambda: mdep_status(kube, ns, "chat").get("readyReplicas") == 1, timeout=300)
    gw = start_gateway(cluster, kubeconfig, keys_ns, "limits")
    try:
        wait_for("the gateway sees the replica", lambda: gw.metric("kvfleet_gateway_ready_replicas", namespace=ns)
                 == 1, timeout=60)
        model = f"{ns}/chat"
        # requests per minute: 3 go, the 4th is refused
        for _ in range(3):
            assert chat(gw, keys["rpm"]).status_code == 200
        resp = chat(gw, keys["rpm"])
        assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"
        assert "3 requests per minute" in resp.json()["error"]["message"]
        assert "requestsPerMinute" in resp.json()["error"]["message"]
        # tokens per minute: the first request's usage (prompt + 32 completion) passes 40, the next is refused
        first = chat(gw, keys["tpm"], model=model, max_tokens=32, min_tokens=32, ignore_eos=True)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        assert used >= 40
        resp = chat(gw, keys["tpm"], model=model)
        assert resp.status_code == 429 and "tokensPerMinute" in resp.json()["error"]["message"]
        assert f"{used} in the last 60s" in resp.json()["error"]["message"]
        # concurrent requests: one long request in flight, a second is refused, after it one goes again
        long_done = threading.Event()
        out: dict[str, int] = {}

        def long_request() -> None:   # as long as the tiny model's 1024 positions allow (24 prompt tokens)
            out["status"] = chat(gw, keys["conc"], model=model, max_tokens=960, min_tokens=960,
                                 ignore_eos=True).status_code
            long_done.set()

        threading.Thread(target=long_request, daemon=True).start()
        # checked closely (not wait_for's 0.25 s), so the second request follows the first while it surely runs
        deadline = time.monotonic() + 30
        while gw.metric("kvfleet_gateway_tenant_requests_in_progress", tenant=names["conc"]) != 1:
            assert time.monotonic() < deadline, "timed out waiting for the long request in flight"
            time.sleep(0.02)
        resp = chat(gw, keys["conc"], model=model)
        assert resp.status_code == 429, resp.text
        assert "limit of 1 concurrent requests (maxConcurrentRequests)" in resp.json()["error"]["message"]
        assert long_done.wait(120) and out["status"] == 200
        assert chat(gw, keys["conc"], model=model).status_code == 200
        for tenant, limit in ((names["rpm"], "requests_per_minute"), (names["tpm"], "tokens_per_minute"),
                              (names["conc"], "concurrent_requests")):
            assert gw.metric("kvfleet_gateway_limited_requests_total", tenant=tenant, limit=limit) == 1
    finally:
        gw.stop()


def test_limits_hold_across_two_gateway_replicas(kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any,
                                                 kubeconfig: str, keys_ns: KeyNamespace) -> None:
    key = keys_ns.write("fz-two")
    tenant, ns = tenants.create("fz-two", [{"flavor": flavors["h200"], "nominal": 1}],
                                gateway={"apiKeySecrets": [{"name": "fz-two"}], "limits": {"requestsPerMinute": 4}})
    kube.apply(model_deployment("chat", ns, flavors["h200"], replicas=1))
    wait_for("chat ready", lambda: mdep_status(kube, ns, "chat").get("readyReplicas") == 1, timeout=300)
    one, two = (GatewayProcess(Path(cluster.logs) / f"gateway-two-{i}.log", kubeconfig=kubeconfig,
                               args=["--keys-namespace", keys_ns.name, "--scrape-interval", "0.5"]) for i in (1, 2))
    one.argv += ["--peers", f"http://127.0.0.1:{two.metrics_port}"]  # each reads the other's usage
    two.argv += ["--peers", f"http://127.0.0.1:{one.metrics_port}"]
    one.start()
    two.start()
    try:
        for gw in (one, two):
            wait_for("the replica seen", lambda gw=gw: gw.metric("kvfleet_gateway_ready_replicas", namespace=ns) == 1,
                     timeout=60)

        def counted(gw: GatewayProcess) -> int:
            """Requests of the tenant in the window as `gw` counts them against the limit (its own and its peer's)."""
            usage = httpx.get(f"http://127.0.0.1:{gw.metrics_port}/usage?view=all", timeout=5, trust_env=False).json()
            return int(usage["tenants"].get(tenant, {}).get("requests", 0))

        for gw in (one, one, two):
            assert chat(gw, key).status_code == 200
        wait_for("each replica counts all 3", lambda: counted(one) == 3 and counted(two) == 3, timeout=10)
        assert chat(two, key).status_code == 200  # the 4th: at the limit
        wait_for("each replica counts all 4", lambda: counted(one) == 4 and counted(two) == 4, timeout=10)
        for gw in (one, two):  # per replica, each would still admit (2 of 4 each): shared, both refuse
            resp = chat(gw, key)
            assert resp.status_code == 429, resp.text
            assert "4 requests per minute" in resp.json()["error"]["message"]
            assert int(resp.headers["Retry-After"]) >= 1
    finally:
        two.stop()
        one.stop()
