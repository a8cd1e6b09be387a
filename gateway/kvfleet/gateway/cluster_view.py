"""The snapshot from the API server's objects (pure): Tenants, ModelDeployments, engine Pods, key Secrets.

- A tenant's namespaces are those of its spec that the operator also reports as its own
  (`status.namespaces`): a namespace another tenant holds, or a platform namespace, never serves it.
- A ModelDeployment belongs to the tenant that owns its namespace; its served name is the operator's
  (`kvfleet.operator.spec.served_name`).
- A replica is a Ready (its engine's /health answers), not terminating pod labelled with its ModelDeployment.
- Keys come from the Secrets each Tenant names in `spec.gateway.apiKeySecrets`, in `keys_namespace`;
  limits and weight from the rest of its `spec.gateway` (`tenancy`).
- A ModelDeployment's `spec.gateway.sharedWith` names other Tenants whose keys may use it too.
- Its `spec.apiKeySecretRef` says where its engines' own key is (read per request, `engine_key_store`).
- Its autoscaling, status counts, quota condition and `engine.maxNumSeqs` are what holding requests at
  zero and saturation need (`waking.ModelScale`).
- Peers (the other gateway replicas, for shared limits) are the Ready pods the peer watch lists, but this one.
"""

from __future__ import annotations

import calendar
import time
from typing import Any, Iterable, Mapping

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.engine_keys import EngineKeyRef
from kvfleet.gateway.keys import SecretRef, build_key_table
from kvfleet.gateway.replicas import replicas_by_model, url_for
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.tenancy import tenant_policy
from kvfleet.gateway.waking import model_scale
from kvfleet.operator.spec import engine_key_secret, served_name, tenant_key_secrets

Obj = Mapping[str, Any]


def tenant_namespaces(tenant: Obj) -> tuple[str, ...]:
    spec_ns = list((tenant.get("spec") or {}).get("namespaces") or ())
    held = set((tenant.get("status") or {}).get("namespaces") or ())
    return tuple(ns for ns in spec_ns if ns in held)


def _created(meta: Obj) -> int:
    stamp = meta.get("creationTimestamp")
    if not stamp:
        return 0
    try:
        return calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return 0


def shared_with(mdep: Obj, owner: str, known: set[str]) -> tuple[str, ...]:
    """The other existing Tenants the ModelDeployment is shared with (`spec.gateway.sharedWith`), sorted."""
    names = ((mdep.get("spec") or {}).get("gateway") or {}).get("sharedWith") or ()
    return tuple(sorted({str(n) for n in names if isinstance(n, str) and n in known and n != owner}))


def model_refs(tenants: Iterable[Obj], mdeps: Iterable[Obj]) -> list[ModelRef]:
    tenants = list(tenants)
    known = {t["metadata"]["name"] for t in tenants}
    owner: dict[str, str] = {}
    for tenant in tenants:
        name = tenant["metadata"]["name"]
        for ns in tenant_namespaces(tenant):
            owner.setdefault(ns, name)  # the operator gives a namespace to one tenant only
    out = []
    for mdep in mdeps:
        meta = mdep.get("metadata") or {}
        ns = str(meta.get("namespace") or "")
        if ns not in owner or meta.get("deletionTimestamp"):
            continue
        spec = mdep.get("spec") or {}
        model = spec.get("model") or {}
        kind = str((spec.get("engine") or {}).get("kind", "kvfleet"))
        secret = engine_key_secret(spec)
        out.append(ModelRef(tenant=owner[ns], namespace=ns, deployment=meta["name"], served_name=served_name(model),
                            engine_kind=kind, created=_created(meta), source=model.get("source"),
                            shared_with=shared_with(mdep, owner[ns], known),
                            engine_key=EngineKeyRef(ns, secret.name, secret.key, kind) if secret else None))
    return out


def key_refs(tenants: Iterable[Obj], keys_namespace: str) -> dict[str, list[SecretRef]]:
    return {t["metadata"]["name"]: [SecretRef(keys_namespace, n) for n in tenant_key_secrets(t.get("spec") or {})]
            for t in tenants}


def peer_urls(pods: Iterable[Obj], self_name: str | None) -> tuple[str, ...]:
    """Metrics URLs of the Ready gateway pods other than `self_name` (their port named `metrics`)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        if meta.get("name") == self_name or meta.get("deletionTimestamp") or not ready or not status.get("podIP"):
            continue
        ports = [p.get("containerPort") for c in (pod.get("spec") or {}).get("containers") or ()
                 for p in c.get("ports") or () if p.get("name") == "metrics"]
        if ports and isinstance(ports[0], int):
            out.append(url_for(str(status["podIP"]), ports[0]))
    return tuple(sorted(out))


def build_snapshot(tenants: Iterable[Obj], mdeps: Iterable[Obj], pods: Iterable[Obj], secrets: Iterable[Obj],
                   keys_namespace: str, peers: tuple[str, ...] = ()) -> Snapshot:
    tenants = list(tenants)
    mdeps = list(mdeps)
    secret_data = {SecretRef(s["metadata"].get("namespace", ""), s["metadata"]["name"]): s.get("data") or {}
                   for s in secrets}
    keys, problems = build_key_table(key_refs(tenants, keys_namespace), secret_data)
    refs = model_refs(tenants, mdeps)
    known = {m.key for m in refs}
    replicas = {k: v for k, v in replicas_by_model(pods).items() if k in known}
    by_key = {f"{(m.get('metadata') or {}).get('namespace')}/{(m.get('metadata') or {}).get('name')}": m
              for m in mdeps}
    scale = {k: model_scale(by_key[k]) for k in known}
    policies = {t["metadata"]["name"]: tenant_policy((t.get("spec") or {}).get("gateway")) for t in tenants}
    return Snapshot(keys=keys, catalog=build_catalog(refs), replicas=replicas, problems=tuple(problems),
                    scale=scale, policies=policies, peers=peers)
