"""The snapshot from the API server's objects (pure): Tenants, ModelDeployments, engine Pods, key Secrets.

- A tenant's namespaces are those of its spec that the operator also reports as its own
  (`status.namespaces`): a namespace another tenant holds, or a platform namespace, never serves it.
- A ModelDeployment belongs to the tenant that owns its namespace; its served name is the operator's
  (`kvfleet.operator.spec.served_name`).
- A replica is a Ready (its engine's /health answers), not terminating pod labelled with its ModelDeployment.
- Keys come from the Secrets each Tenant names in `spec.gateway.apiKeySecrets`, in `keys_namespace`.
"""

from __future__ import annotations

import calendar
import time
from typing import Any, Iterable, Mapping

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.keys import SecretRef, build_key_table
from kvfleet.gateway.replicas import replicas_by_model
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.operator.spec import served_name, tenant_key_secrets

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


def model_refs(tenants: Iterable[Obj], mdeps: Iterable[Obj]) -> list[ModelRef]:
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
        out.append(ModelRef(tenant=owner[ns], namespace=ns, deployment=meta["name"], served_name=served_name(model),
                            engine_kind=str((spec.get("engine") or {}).get("kind", "kvfleet")),
                            created=_created(meta), source=model.get("source")))
    return out


def key_refs(tenants: Iterable[Obj], keys_namespace: str) -> dict[str, list[SecretRef]]:
    return {t["metadata"]["name"]: [SecretRef(keys_namespace, n) for n in tenant_key_secrets(t.get("spec") or {})]
            for t in tenants}


def build_snapshot(tenants: Iterable[Obj], mdeps: Iterable[Obj], pods: Iterable[Obj], secrets: Iterable[Obj],
                   keys_namespace: str) -> Snapshot:
    tenants = list(tenants)
    secret_data = {SecretRef(s["metadata"].get("namespace", ""), s["metadata"]["name"]): s.get("data") or {}
                   for s in secrets}
    keys, problems = build_key_table(key_refs(tenants, keys_namespace), secret_data)
    refs = model_refs(tenants, mdeps)
    known = {m.key for m in refs}
    replicas = {k: v for k, v in replicas_by_model(pods).items() if k in known}
    return Snapshot(keys=keys, catalog=build_catalog(refs), replicas=replicas, problems=tuple(problems))
