"""The demo's gateway act: one OpenAI endpoint for every tenant, the key deciding what it reaches.

Keys are Secrets in the gateway's namespace (kvfleet-system) that the sample Tenants name
(`spec.gateway.apiKeySecrets`); the gateway runs as a local process against the cluster (loopback only), as the
operator does. team-a's key gets a chat answered by a pod of team-a's ModelDeployment; team-b's key is refused it.
"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
from openai import OpenAI

from kvfleet.gateway.testing import GatewayProcess
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import wait_for

API = "serving.kvfleet.dev/v1alpha1"

KEYS_NAMESPACE = "kvfleet-system"


def create_keys(kubectl: Callable[..., str], note: Callable[..., None]) -> dict[str, str]:
    keys = {}
    for tenant in ("team-a", "team-b"):
        keys[tenant] = f"sk-{tenant}-{secrets.token_hex(16)}"
        manifest = kubectl("create", "secret", "generic", f"{tenant}-keys", "--namespace", KEYS_NAMESPACE,
                           f"--from-literal=key1={keys[tenant]}", "--dry-run=client", "-o", "json")
        kubectl("apply", "-f", "-", stdin=manifest)
        note(f"kubectl -n {KEYS_NAMESPACE} create secret generic {tenant}-keys --from-literal=key1=sk-{tenant}-...  "
             f"(named by Tenant {tenant}: spec.gateway.apiKeySecrets)")
    return keys


def gateway_act(kubeconfig: str, logs: Path, kubectl: Callable[..., str], say: Callable[[str], None],
                note: Callable[..., Any], green: str, yellow: str, dim: str) -> dict[str, str]:
    say("The gateway: one OpenAI endpoint for every tenant; the API key names the tenant")
    keys = create_keys(kubectl, note)
    gateway = GatewayProcess(logs / "gateway-demo.log", kubeconfig=kubeconfig,
                             args=["--keys-namespace", KEYS_NAMESPACE]).start()
    try:
        note(f"kvfleet gateway --keys-namespace {KEYS_NAMESPACE}  ->  {gateway.url}/v1  "
             f"(log: {gateway.log_path})", dim)
        wait_for("the gateway sees team-a's replicas", lambda: gateway.metric(
            "kvfleet_gateway_ready_replicas", namespace="team-a", model="smollm2") >= 1, timeout=60)
        http = httpx.Client(trust_env=False)
        team_a = OpenAI(base_url=gateway.url + "/v1", api_key=keys["team-a"], http_client=http, max_retries=0)
        team_b = OpenAI(base_url=gateway.url + "/v1", api_key=keys["team-b"], http_client=http, max_retries=0)
        note(f"team-a's key sees: {', '.join(m.id for m in team_a.models.list().data)}")
        note(f"team-b's key sees: {', '.join(m.id for m in team_b.models.list().data)}")
        question = "In one sentence, what is a GPU?"
        note(f"team-a asks smollm2: {question}")
        raw = team_a.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0)
        reply = raw.parse()
        note(f"assistant: {(reply.choices[0].message.content or '').strip()}", green)
        note(f"answered by pod {raw.headers.get('x-kvfleet-replica')} (team-a's ModelDeployment chat); usage "
             f"{json.dumps(reply.usage.model_dump() if reply.usage else {})}", dim)
        try:
            team_b.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                           max_tokens=8)
            raise RuntimeError("team-b's key reached team-a's model")
        except openai.NotFoundError as err:
            note(f"team-b asks smollm2: {err.status_code} {err.body.get('message')}", yellow)
        try:
            OpenAI(base_url=gateway.url + "/v1", api_key="sk-not-a-key-000000000000", http_client=http,
                   max_retries=0).models.list()
        except openai.AuthenticationError as err:
            note(f"a wrong key: {err.status_code} {err.body.get('message')}", yellow)
        tokens = gateway.metric("kvfleet_gateway_completion_tokens_total", tenant="team-a")
        note(f"kvfleet_gateway_completion_tokens_total{{tenant=\"team-a\"}} = {tokens:.0f} (chargeback)", dim)
    finally:
        gateway.stop()
    return keys


def _status(kube: Kube, name: str) -> dict[str, Any]:
    return (kube.get(API, "modeldeployments", name, "team-a") or {}).get("status") or {}


def _pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    return [p for p in kube.list("v1", "pods", "team-a", f"serving.kvfleet.dev/modeldeployment={name}")
            if not p["metadata"].get("deletionTimestamp")]


def wake_act(kubeconfig: str, logs: Path, kube: Kube, kubectl: Callable[..., str], manifests: Path,
             keys: dict[str, str], say: Callable[[str], None], note: Callable[..., Any], green: str, yellow: str,
             dim: str) -> None:
    """A model at zero: refused within quota while the cohort's GPUs are lent out, woken once they come back,
    and back to zero after its delay."""
    say("team-a/sleepy sleeps at zero replicas (autoscaling.minReplicas: 0) and wakes on a request")
    kubectl("apply", "-f", str(manifests / "team-a-sleepy.yaml"))
    note("kubectl apply -f manifests/team-a-sleepy.yaml   (replicas 0, 1 H200 GPU each, scaleDownDelaySeconds 20)")
    wait_for("sleepy at zero", lambda: _status(kube, "sleepy").get("desiredReplicas") == 0, timeout=60)
    gateway = GatewayProcess(logs / "gateway-demo-wake.log", kubeconfig=kubeconfig,
                             args=["--keys-namespace", KEYS_NAMESPACE]).start()
    http = httpx.Client(trust_env=False, timeout=600)
    team_a = OpenAI(base_url=gateway.url + "/v1", api_key=keys["team-a"], http_client=http, max_retries=0)
    messages: Any = [{"role": "user", "content": "In one sentence, what is a queue?"}]
    try:
        wait_for("the gateway lists sleepy", lambda: "sleepy" in {m.id for m in team_a.models.list().data},
                 timeout=60)
        note(f"pods of sleepy: {len(_pods(kube, 'sleepy'))}; team-b borrows team-a's 2 spare H200s (summarizer)")
        note("team-a asks sleepy: the gateway holds the request and asks the autoscaler for a replica")
        try:
            team_a.chat.completions.create(model="sleepy", messages=messages, max_tokens=16)
            raise RuntimeError("sleepy answered while its quota was lent out")
        except openai.RateLimitError as err:
            note(f"{err.status_code}, Retry-After {err.response.headers.get('retry-after')}s: "
                 f"{err.body.get('message')}", yellow)
        note(f"pods of sleepy: {len(_pods(kube, 'sleepy'))} (Kueue admitted nothing: quota is never bypassed)")
        kubectl("delete", "mdep/summarizer", "--namespace", "team-b", "--wait=false")
        note("kubectl delete mdep/summarizer -n team-b   (its 2 borrowed GPUs go back to the cohort)")
        wait_for("sleepy within quota", lambda: not any(
            c["type"] == "QuotaExceeded" and c["status"] == "True" for c in _status(kube, "sleepy").get("conditions")
            or ()), timeout=120)
        note(f"Kueue: sleepy within quota again ({_status(kube, 'sleepy').get('admittedReplicas', 0)} admitted, "
             f"{_status(kube, 'sleepy').get('readyReplicas', 0)} Ready)")
        note("team-a asks sleepy again (streaming): held at the gateway until a replica is Ready")
        ready_before = _status(kube, "sleepy").get("readyReplicas", 0)
        start = time.monotonic()
        first = None
        text = ""
        for chunk in team_a.chat.completions.create(model="sleepy", messages=messages, max_tokens=48,
                                                    temperature=0, stream=True):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta and first is None:
                first = time.monotonic() - start
            text += delta or ""
        note(f"assistant: {text.strip()}", green)
        st = _status(kube, "sleepy")
        note(f"first token {first:.1f}s after the request, asked with {ready_before} Ready replicas (Kueue "
             f"admission, pod start, engine load on CPU); sleepy now {st.get('readyReplicas')} Ready", green)
        note("waiting for sleepy to go back to zero (20 s without requests, then the autoscaler's next tick) ...",
             dim)
        start = time.monotonic()
        wait_for("sleepy back at zero", lambda: _status(kube, "sleepy").get("desiredReplicas") == 0
                 and not _pods(kube, "sleepy"), timeout=180)
        note(f"sleepy back at zero replicas after {time.monotonic() - start:.0f}s; its GPU is free again", green)
    finally:
        gateway.stop()
