"""Reconcile one Tenant: namespaces, ClusterQueue, and per namespace LocalQueue, NetworkPolicy
and RBAC; clean up namespaces it no longer lists; report GPU usage per flavor."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from .builders import build_cluster_queue, build_local_queue, build_namespace, build_network_policy, build_rbac
from .constants import API_VERSION, KUEUE_API_VERSION, LABEL_TENANT, TENANT_PLURAL
from .errors import SpecError
from .events import build_event
from .kube import PLURALS, Kube
from .reconcile import post_event, utcnow
from .refs import ApiRefs, Refs
from .spec import TenantSpec, parse_tenant
from .tenant_status import compute_tenant_status, namespace_conflicts, usage_refresh

log = logging.getLogger("kvfleet.operator.tenant")

# (apiVersion, plural) of the per-namespace objects a Tenant owns, for clean-up.
NAMESPACED_OWNED = (
    (KUEUE_API_VERSION, "localqueues"),
    ("networking.k8s.io/v1", "networkpolicies"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
    ("rbac.authorization.k8s.io/v1", "roles"),
)


def _cleanup(kube: Kube, tenant_name: str, wanted: dict[str, set[tuple[str, str]]]) -> None:
    """Delete what we made in namespaces (or for a group) the Tenant no longer lists."""
    selector = f"{LABEL_TENANT}={tenant_name}"
    for api_version, plural in NAMESPACED_OWNED:
        for obj in kube.list(api_version, plural, None, selector):
            meta = obj["metadata"]
            if (plural, meta["name"]) not in wanted.get(meta["namespace"], set()):
                kube.delete(api_version, plural, meta["name"], meta["namespace"])
    for ns in kube.list("v1", "namespaces", None, selector):
        if ns["metadata"]["name"] not in wanted:
            # Applying the namespace without our labels drops them (we own only those fields).
            kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns["metadata"]["name"]}})


def reconcile_tenant(kube: Kube, name: str, converge: bool = True,
                     system_namespaces: Sequence[str] = (), pod_security: str = "restricted",
                     refs: Refs | None = None) -> dict[str, Any] | None:
    """Apply what the Tenant becomes (unless `converge` is False: then only refresh its status).

    `system_namespaces` may reach the tenant's engines through its NetworkPolicy (the operator's own);
    a tenant may not have one of them (Ready=False, ReservedNamespace). `pod_security` is the Pod Security
    Standard its namespaces enforce. `refs` tells which tenant labels each namespace (default: read from the
    apiserver)."""
    tenant = kube.get(API_VERSION, TENANT_PLURAL, name)
    if tenant is None or tenant["metadata"].get("deletionTimestamp"):
        return None
    now = utcnow()
    old_status = tenant.get("status") or {}
    try:
        spec = parse_tenant(tenant.get("spec") or {})
    except SpecError as exc:
        status = compute_tenant_status(tenant, None, exc.message, [], now)
    else:
        conflicts = _conflicts(kube, refs or ApiRefs(kube), name, spec)
        reserved = [ns for ns in spec.namespaces if ns in system_namespaces]
        skip = set(conflicts) | set(reserved)
        if converge:
            _converge(kube, tenant, spec, skip=skip, system_namespaces=system_namespaces, pod_security=pod_security)
        workloads = [w for ns in spec.namespaces if ns not in skip
                     for w in kube.list(KUEUE_API_VERSION, "workloads", ns)]
        status = compute_tenant_status(tenant, spec, None, workloads, now, conflicts, reserved)
    if not converge:
        status = usage_refresh(old_status, status)
    if {k: old_status.get(k) for k in status} != status:
        kube.merge_patch(tenant, {"status": status}, subresource="status")
        old_ready: dict[str, Any] = next(
            (c for c in old_status.get("conditions") or [] if c["type"] == "Ready"), {})
        ready = status["conditions"][0]
        if (old_ready.get("status"), old_ready.get("reason")) != (ready["status"], ready["reason"]):
            kind = "Normal" if ready["status"] == "True" else "Warning"
            post_event(kube, build_event(tenant, kind, ready["reason"], ready["message"], now))
    return status


def _conflicts(kube: Kube, refs: Refs, name: str, spec: TenantSpec) -> dict[str, str]:
    owners = {ns: refs.namespace_tenant(ns) for ns in spec.namespaces}
    others = {o for o in owners.values() if o and o != name}
    live = {o for o in others if kube.get(API_VERSION, TENANT_PLURAL, o) is not None}
    return namespace_conflicts(name, owners, live)


def _converge(kube: Kube, tenant: dict[str, Any], spec: TenantSpec, skip: set[str],
              system_namespaces: Sequence[str] = (), pod_security: str = "restricted") -> None:
    name = tenant["metadata"]["name"]
    kube.apply(build_cluster_queue(tenant, spec))
    wanted: dict[str, set[tuple[str, str]]] = {}
    for ns in spec.namespaces:
        if ns in skip:
            continue
        objs = [build_namespace(name, ns, pod_security), build_local_queue(tenant, ns),
                build_network_policy(tenant, ns, system_namespaces),
                *build_rbac(tenant, spec, ns)]
        for obj in objs:
            kube.apply(obj)
        wanted[ns] = {(PLURALS[o["kind"]], o["metadata"]["name"]) for o in objs[1:]}
    _cleanup(kube, name, wanted)

