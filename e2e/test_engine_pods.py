"""Engine pods that really serve: the local cluster's engine kubelet runs a real `kvfleet serve` (CPU, the tiny
model) for each pod of a ModelDeployment, on the pod's loopback IP; the pod is Ready only while /health answers;
a killed engine makes the pod unready and is restarted as a kubelet restarts a container; a deleted pod's engine
stops; a crashed engine kubelet leaves no engine behind. Clients are the real `openai` client, at the pod IP."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import wait_for

from local_engines import base_url, container_status, engines, is_ready, pid_alive
from localcluster import control
from operator_fixtures import API, deployments, engine_pods, mdep_status, model_deployment

pytestmark = pytest.mark.timeout(420)

KEY = "sk-e2e-team"
NEW_KEY = "sk-e2e-team-rotated"
ENGINE_START_S = 180  # a cold tiny engine on two busy shared cores: import torch, load, warm up


def models_status(pod: dict[str, Any], key: str) -> int:
    return httpx.get(f"{base_url(pod)}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10,
                     trust_env=False).status_code


def one_pod(kube: Kube, ns: str, name: str, ready: bool | None = None) -> dict[str, Any] | None:
    """The ModelDeployment's only live pod (when `ready` is given, only if its readiness is that)."""
    pods = engine_pods(kube, ns, name)
    if len(pods) != 1 or not (pods[0].get("status") or {}).get("podIP"):
        return None
    return pods[0] if ready is None or is_ready(pods[0]) == ready else None


def engine_row(cluster: Any, ns: str, pod: str) -> dict[str, Any] | None:
    return next((r for r in engines(cluster, ns) if r["pod"] == pod and r["pid"]), None)


def chat(pod: dict[str, Any], model: str, api_key: str = "none") -> Any:
    client = openai.OpenAI(base_url=f"{base_url(pod)}/v1", api_key=api_key, max_retries=0, timeout=60,
                           http_client=httpx.Client(trust_env=False))  # fmt: skip
    return client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip


def listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


class Sampler:
    """Samples (pod Ready, then /health) of a ModelDeployment's pod until stopped: Ready must never come before
    the engine answers /health."""

    def __init__(self, kube: Kube, ns: str, name: str) -> None:
        self.kube, self.ns, self.name = kube, ns, name
        self.samples: list[tuple[bool, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                pod = one_pod(self.kube, self.ns, self.name)
            except Exception:  # noqa: BLE001 (a busy apiserver: sample again)
                continue
            if pod is None:
                continue
            ready = is_ready(pod)  # first the pod, then the engine: Ready then means /health had answered
            try:
                code: int | None = httpx.get(f"{base_url(pod)}/health", timeout=2, trust_env=False).status_code
            except httpx.HTTPError:
                code = None
            self.samples.append((ready, code))


def test_a_pod_serves_chat_at_its_ip_and_is_ready_only_once_its_engine_is_healthy(
        kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any, kubectl: Any) -> None:  # fmt: skip
    _, ns = tenants.create("serve", [{"flavor": flavors["h200"], "nominal": 2}])
    kubectl("create", "secret", "generic", "chat-keys", f"--from-literal=keys.yaml={KEY}: team-e2e", namespace=ns)
    kube.apply(model_deployment("chat", ns, flavors["h200"], apiKeySecretRef={"name": "chat-keys", "key": "keys.yaml"}))
    with Sampler(kube, ns, "chat") as sampler:
        pod = wait_for("the pod Ready", lambda: one_pod(kube, ns, "chat", ready=True), timeout=ENGINE_START_S)
        time.sleep(1)  # a few samples while Ready
    # Unready while the engine loaded (no answer, or 503 'loading'), Ready only after /health said 200.
    assert any(not ready and code != 200 for ready, code in sampler.samples), sampler.samples
    assert all(code == 200 for ready, code in sampler.samples if ready), sampler.samples
    status = container_status(pod)
    assert status["ready"] and status["started"] and status["restartCount"] == 0, status
    ready_at = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"]
    assert ready_at >= status["state"]["running"]["startedAt"]

    # The ModelDeployment counts it: the Deployment controller saw the pod Ready.
    wait_for("readyReplicas 1", lambda: mdep_status(kube, ns, "chat").get("readyReplicas") == 1, timeout=60)
    assert sum(d["status"].get("readyReplicas", 0) for d in deployments(kube, ns, "chat")) == 1

    # A real engine on the pod's loopback IP and port, on CPU, started by the engine kubelet.
    row = engine_row(cluster, ns, pod["metadata"]["name"])
    assert row and row["model"] == "tiny" and row["ready"] and row["ip"] == pod["status"]["podIP"], row
    with open(f"/proc/{row['pid']}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    assert argv[argv.index("--host") + 1] == pod["status"]["podIP"] and "kvfleet.engine.cli" in argv
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--served-model-name") + 1] == "chat"

    # The openai client at the pod IP, with the key from the ModelDeployment's Secret (mounted as a volume).
    client = openai.OpenAI(base_url=f"{base_url(pod)}/v1", api_key=KEY, http_client=httpx.Client(trust_env=False))
    assert [m.id for m in client.models.list().data] == ["chat"]
    reply = chat(pod, "chat", KEY)
    assert reply.model == "chat" and reply.choices[0].message.content is not None
    assert 0 < reply.usage.completion_tokens <= 8
    with pytest.raises(openai.AuthenticationError):
        chat(pod, "chat", "sk-wrong")

    # The Secret rotated: the kubelet swaps the volume's files, the engine reads them again, no restart.
    kubectl("patch", "secret", "chat-keys", "-p", json.dumps({"stringData": {"keys.yaml": f"{NEW_KEY}: team-e2e"}}),
            namespace=ns)
    wait_for("the rotated key to work", lambda: models_status(pod, NEW_KEY) == 200, timeout=60)
    assert models_status(pod, KEY) == 401
    assert chat(pod, "chat", NEW_KEY).usage.completion_tokens > 0
    assert engine_row(cluster, ns, pod["metadata"]["name"])["pid"] == row["pid"]   # the same engine process


def test_a_killed_engine_unreadies_its_pod_and_restarts_and_a_deleted_pod_takes_its_engine_along(
        kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any) -> None:  # fmt: skip
    _, ns = tenants.create("restart", [{"flavor": flavors["h200"], "nominal": 2}])
    kube.apply(model_deployment("chat", ns, flavors["h200"]))
    pod = wait_for("the pod Ready", lambda: one_pod(kube, ns, "chat", ready=True), timeout=ENGINE_START_S)
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    first = engine_row(cluster, ns, name)
    assert first is not None

    # The engine dies (SIGKILL, as the OOM killer would): the pod turns unready and the engine is restarted
    # at once (a kubelet's first restart), counted in restartCount with the end in lastState.
    os.kill(first["pid"], signal.SIGKILL)
    crashed = wait_for("pod unready, container restarted", lambda: (p := one_pod(kube, ns, "chat", ready=False))
                       and container_status(p).get("restartCount") == 1 and p, timeout=30)
    assert crashed["metadata"]["name"] == name  # the same pod: a container restart, not a new pod
    last = container_status(crashed)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (137, "Error"), last
    back = wait_for("Ready again", lambda: one_pod(kube, ns, "chat", ready=True), timeout=ENGINE_START_S)
    second = engine_row(cluster, ns, name)
    assert second and second["pid"] != first["pid"] and second["restarts"] == 1 and not pid_alive(first["pid"])
    assert chat(back, "chat").choices

    # Deleting the pod: the engine is stopped (SIGTERM: it drains) before the pod goes; the Deployment's
    # replacement gets an engine of its own.
    kube.delete("v1", "pods", name, ns)
    wait_for("the pod gone", lambda: not [p for p in kube.list("v1", "pods", ns) if p["metadata"]["name"] == name],
             timeout=60)
    assert not pid_alive(second["pid"]) and not listening(ip, 8000)
    replacement = wait_for("a new pod Ready", lambda: one_pod(kube, ns, "chat", ready=True), timeout=ENGINE_START_S)
    assert replacement["metadata"]["name"] != name
    new = engine_row(cluster, ns, replacement["metadata"]["name"])
    assert new and new["restarts"] == 0

    # Scaled to zero: no engine left for the namespace, no process.
    kube.merge_patch({"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": "chat", "namespace": ns}},
                     {"spec": {"replicas": 0}})
    wait_for("no engine left", lambda: not engines(cluster, ns) and not engine_pods(kube, ns, "chat"), timeout=60)
    assert not pid_alive(new["pid"])


def test_a_crashed_engine_kubelet_leaves_no_engine_and_a_new_one_serves_the_pods_again(
        kube: Kube, tenants: Any, flavors: dict[str, str], cluster: Any) -> None:  # fmt: skip
    _, ns = tenants.create("crash", [{"flavor": flavors["h200"], "nominal": 2}])
    kube.apply(model_deployment("chat", ns, flavors["h200"]))
    pod = wait_for("the pod Ready", lambda: one_pod(kube, ns, "chat", ready=True), timeout=ENGINE_START_S)
    row = engine_row(cluster, ns, pod["metadata"]["name"])
    assert row is not None
    kubelet_pid = control.procs.running_pid(cluster.run, "engine-kubelet")
    assert kubelet_pid is not None
    os.kill(kubelet_pid, signal.SIGKILL)
    # The kernel takes the engines along (PR_SET_PDEATHSIG): nothing is left listening on the pod's address
    # (the last of the engine's threads may close it a moment after its main thread is gone).
    wait_for("the engine gone with the engine kubelet", lambda: not pid_alive(row["pid"])
             and not listening(row["ip"], row["port"]), timeout=10)
    # `cluster.py up` (here control.up) restarts only the engine kubelet; it serves the pod again, counted as a
    # container restart.
    assert control.up(cluster)
    again = wait_for("Ready again", lambda: (p := one_pod(kube, ns, "chat", ready=True))
                     and container_status(p)["restartCount"] == 1 and p, timeout=ENGINE_START_S)
    assert again["metadata"]["uid"] == pod["metadata"]["uid"]
    assert chat(again, "chat").choices
