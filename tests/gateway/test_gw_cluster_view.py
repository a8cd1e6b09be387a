"""The snapshot from Kubernetes objects: namespaces the operator gave the tenant, ready pods, keys."""

from __future__ import annotations

import base64
from typing import Any

from kvfleet.gateway.cluster_view import build_snapshot, tenant_namespaces
from kvfleet.gateway.replicas import pod_replica

KEY = "team-a-key-0123456789"


def tenant(name: str, spec_ns: list[str], held: list[str], secrets: list[str] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"namespaces": spec_ns, "quotas": [{"flavor": "h200", "nominal": 1}]}
    if secrets:
        spec["gateway"] = {"apiKeySecrets": [{"name": s} for s in secrets]}
    return {"metadata": {"name": name}, "spec": spec, "status": {"namespaces": held}}


def mdep(ns: str, name: str, served: str | None = None, source: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
         **meta: Any) -> dict[str, Any]:
    model = {"source": source, **({"servedName": served} if served else {})}
    return {"metadata": {"namespace": ns, "name": name, "creationTimestamp": "2026-01-02T03:04:05Z", **meta},
            "spec": {"model": model, "engine": {"kind": "kvfleet"}}}


def pod(ns: str, name: str, mdep_name: str, ip: str = "127.0.0.5", ready: bool = True, phase: str = "Running",
        deleting: bool = False, port: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ns, "name": name, "labels": {"serving.kvfleet.dev/modeldeployment": mdep_name}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-02T03:04:05Z"
    spec = {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]} if port else {}
    return {"metadata": meta, "spec": spec, "status": {
        "phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def secret(ns: str, name: str, **data: str) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def test_a_tenant_has_the_namespaces_of_its_spec_that_the_operator_reports_as_held() -> None:
    assert tenant_namespaces(tenant("a", ["x", "y", "z"], ["y", "x", "other"])) == ("x", "y")
    assert tenant_namespaces({"metadata": {"name": "a"}, "spec": {"namespaces": ["x"]}}) == ()


def test_snapshot_models_replicas_and_keys() -> None:
    snap = build_snapshot(
        tenants=[tenant("team-a", ["team-a"], ["team-a"], ["a-keys"]), tenant("team-b", ["team-b", "team-a"],
                                                                              ["team-b"])],
        mdeps=[mdep("team-a", "chat", "smollm2"), mdep("team-b", "coder"), mdep("nobody", "orphan"),
               mdep("team-a", "going", deletionTimestamp="2026-01-02T03:04:05Z")],
        pods=[pod("team-a", "chat-1", "chat", "127.0.0.11"), pod("team-a", "chat-2", "chat", "127.0.0.12", ready=False),
              pod("team-a", "chat-3", "chat", "127.0.0.13", deleting=True),
              pod("team-a", "chat-4", "chat", "127.0.0.14", phase="Failed"),
              pod("team-b", "coder-1", "coder", "127.0.0.21", port=8001), pod("nobody", "orphan-1", "orphan")],
        secrets=[secret("kvfleet-system", "a-keys", k=KEY), secret("kvfleet-system", "unrelated", k="x" * 20)],
        keys_namespace="kvfleet-system")
    assert snap.keys.tenant_for(KEY) == "team-a" and snap.keys.tenant_for("x" * 20) is None
    chat = snap.catalog.resolve("team-a", "smollm2").model
    assert chat is not None and chat.key == "team-a/chat" and chat.created == 1767323045
    coder = snap.catalog.resolve("team-b", "SmolLM2-135M-Instruct").model  # served name: the source's base name
    assert coder is not None and coder.tenant == "team-b"
    assert snap.catalog.resolve("team-b", "smollm2").model is None  # team-a's namespace is not team-b's
    assert [r.url for r in snap.ready_replicas("team-a/chat")] == ["http://127.0.0.11:8000"]
    assert [r.url for r in snap.ready_replicas("team-b/coder")] == ["http://127.0.0.21:8001"]
    assert "nobody/orphan" not in snap.replicas
    assert not snap.problems


def test_a_missing_key_secret_is_a_problem_not_a_failure() -> None:
    snap = build_snapshot([tenant("team-a", ["team-a"], ["team-a"], ["missing"])], [], [], [], "kvfleet-system")
    assert snap.problems == ("tenant team-a: Secret kvfleet-system/missing not found",)


def test_pod_replica_needs_the_label_and_an_ip() -> None:
    assert pod_replica({"metadata": {"name": "x", "namespace": "y"}, "status": {}}) is None
    found = pod_replica(pod("ns", "p", "m", "::1"))
    assert found is not None and found[1].url == "http://[::1]:8000"
