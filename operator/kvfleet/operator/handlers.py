"""kopf handlers: thin edges that call the reconcilers, one pass per object at a time (coalesce.py).

ModelDeployments are reconciled on create/update/resume, on the events of a Workload or Deployment they own
that change what the reconcile reads (triggers.py), and those with their own engine key on a Role or RoleBinding
change in their namespace (what the gateway may read). Tenants on create/update/resume, when one of their queues is
deleted, and (status only) when a workload in their namespaces changes admission. Triggers that arrive while a
pass runs fold into one more pass; a pass the apiserver could not serve runs again after a delay. No timers, so
no finalizers: deleting a ModelDeployment or a Tenant never waits for the operator.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

import httpx
import kopf

from . import metrics
from .applied import AppliedOnce, covers
from .coalesce import Coalescer
from .config import OperatorConfig
from .constants import (
    API_VERSION,
    GROUP,
    KUEUE_GROUP,
    KUEUE_VERSION,
    LABEL_MANAGED_BY,
    LABEL_MDEP,
    LABEL_TENANT,
    MANAGED_BY_VALUE,
    MDEP_PLURAL,
    TENANT_PLURAL,
    VERSION,
)
from .kube import Kube, KubeError
from .reconcile import fixed_children, reconcile_model_deployment
from .reconcile_tenant import reconcile_tenant
from .refs import ApiRefs, WatchedRefs
from .triggers import Fingerprints, deployment_fingerprint, workload_fingerprint

log = logging.getLogger("kvfleet.operator.handlers")

_state_lock = threading.Lock()
_passes = Coalescer()
_workloads_seen = Fingerprints()
_deployments_seen = Fingerprints()
_fixed_applied = AppliedOnce()
_kube: Kube | None = None
_config: OperatorConfig | None = None
_refs: WatchedRefs | None = None


def kube() -> Kube:
    global _kube
    with _state_lock:
        if _kube is None:
            _kube = Kube.from_kubeconfig()
        return _kube


def refs() -> WatchedRefs:
    """Flavors, namespaces' tenants and LocalQueues as the watches below deliver them (read through on a miss)."""
    global _refs
    client = kube()
    with _state_lock:
        if _refs is None:
            _refs = WatchedRefs(ApiRefs(client))
        return _refs


def config() -> OperatorConfig:
    global _config
    with _state_lock:
        if _config is None:
            _config = OperatorConfig.from_env()
        return _config


def _guarded(kind: str, key: str, fn: Callable[[], Any]) -> Any:
    """One reconcile, timed; API errors become kopf.TemporaryError (retried)."""
    with metrics.timed(kind):
        try:
            return fn()
        except KubeError as exc:
            if exc.status == 404:  # deleted while we reconciled it: the garbage collector does the rest
                log.debug("gone while reconciling %s %s: %s", kind, key, exc)
                return None
            # 409: someone changed it under us; others: the apiserver is busy or restarting.
            raise kopf.TemporaryError(f"{kind} {key}: {exc}", delay=1 if exc.status == 409 else 5) from exc
        except httpx.TransportError as exc:  # the apiserver is unreachable for a moment
            raise kopf.TemporaryError(f"{kind} {key}: {exc!r}", delay=5) from exc


# Pass ranks per key: a full tenant reconcile covers a status refresh.
_STATUS_ONLY, _FULL = 0, 1


def _mdep_pass(namespace: str, name: str, *, wait: bool) -> Any:
    key = f"{namespace}/{name}"
    return _passes.run(f"ModelDeployment {key}",
                       lambda: _guarded("ModelDeployment", key, lambda: _reconcile_and_record(namespace, name)),
                       wait=wait)


def _tenant_pass(name: str, *, converge: bool, wait: bool) -> Any:
    def one() -> Any:
        return _guarded("Tenant", name, lambda: reconcile_tenant(
            kube(), name, converge=converge, system_namespaces=config().system_namespaces,
            pod_security=config().tenant_pod_security, refs=refs()))
    return _passes.run(f"Tenant {name}", one, wait=wait, rank=_FULL if converge else _STATUS_ONLY)


# Problems that go away when something else appears (the spec itself is fine): retried.
RETRY_REASONS = frozenset({"FlavorNotFound", "QueueNotFound", "NotATenantNamespace", "PriorityClassNotFound"})
RETRY_DELAY_SECONDS = 10


def waiting_reason(status: dict[str, Any] | None) -> str | None:
    """The Admitted condition's reason when it is one that a later retry may clear."""
    for cond in (status or {}).get("conditions") or ():
        if cond.get("type") == "Admitted" and cond.get("reason") in RETRY_REASONS:
            return str(cond["reason"])
    return None


def _reconcile_and_record(namespace: str, name: str) -> dict[str, Any] | None:
    """Reconcile, then mirror the status counts in the replica gauges (inside the object's pass, so a
    reconcile that ends after the object's deletion cannot bring its series back)."""
    status = reconcile_model_deployment(kube(), config(), namespace, name, _fixed_applied, refs(), _written)
    if status is None:
        metrics.REPLICAS.forget(namespace, name)
    else:
        metrics.REPLICAS.record(namespace, name, status)
    return status


def _written(obj: Mapping[str, Any]) -> None:
    """What a reconcile just created, as the apiserver returned it: the watch's echo of it changes nothing the
    reconcile read, so it needs no pass of its own. Only a fresh object (no status yet) is recorded: status the
    pass did not see must still trigger one."""
    if obj.get("status"):
        return
    meta = obj.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    if obj.get("kind") == "Workload":
        _workloads_seen.changed(key, workload_fingerprint(obj))
    elif obj.get("kind") == "Deployment":
        _deployments_seen.changed(key, deployment_fingerprint(obj))


def namespaced(namespace: str | None) -> str:
    """kopf types a handler's namespace as optional; every object these handlers watch is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object came without a namespace")
    return namespace


def reconcile_now(namespace: str, name: str) -> Any:
    """Reconcile one ModelDeployment now and return its status (the autoscaler calls this after a decision)."""
    return _mdep_pass(namespace, name, wait=True)


@kopf.on.create(GROUP, VERSION, MDEP_PLURAL)
@kopf.on.update(GROUP, VERSION, MDEP_PLURAL)
@kopf.on.resume(GROUP, VERSION, MDEP_PLURAL)
def mdep_changed(namespace: str | None, name: str, **_: Any) -> None:
    namespace = namespaced(namespace)
    status = _mdep_pass(namespace, name, wait=True)
    reason = waiting_reason(status)
    if reason:
        # What it waits for (a flavor, a queue, a tenant) is not watched: kopf retries until it exists.
        raise kopf.TemporaryError(f"{namespace}/{name} waits: {reason}", delay=RETRY_DELAY_SECONDS)


@kopf.on.delete(GROUP, VERSION, MDEP_PLURAL, optional=True)
def mdep_deleted(namespace: str | None, name: str, **_: Any) -> None:
    # Owner references let the garbage collector remove workloads, Deployments and the Service.
    log.info("deleted mdep=%s/%s", namespace, name)


@kopf.on.event(GROUP, VERSION, MDEP_PLURAL)
def mdep_event(type: str | None, namespace: str | None, name: str, **_: Any) -> None:  # noqa: A002 (kopf's name)
    """Gone from the API: drop its replica gauges. Without a finalizer kopf may never call the delete
    handler (the object can vanish before it is seen terminating), but the watch always says DELETED."""
    if type == "DELETED":
        namespace = namespaced(namespace)
        _passes.run(f"ModelDeployment {namespace}/{name}",
                    lambda: metrics.REPLICAS.forget(namespace, name), wait=True)


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloads",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
def owned_workload_event(type: str | None, namespace: str | None, name: str, labels: Mapping[str, str],  # noqa: A002
                         body: Any, **_: Any) -> None:
    namespace = namespaced(namespace)
    key = f"{namespace}/{name}"
    if type == "DELETED":
        _workloads_seen.forget(key)
    elif not _workloads_seen.changed(key, workload_fingerprint(body)):
        return  # nothing the plan reads changed (Kueue's bookkeeping)
    _mdep_pass(namespace, labels[LABEL_MDEP], wait=False)
    # Admission changed the tenant's GPU usage: refresh its status.
    tenant = refs().namespace_tenant(namespace)
    if tenant:
        _tenant_pass(tenant, converge=False, wait=False)


@kopf.on.event("apps", "v1", "deployments",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
def owned_deployment_event(type: str | None, namespace: str | None, name: str, labels: Mapping[str, str],  # noqa: A002
                           body: Any, **_: Any) -> None:
    namespace = namespaced(namespace)
    key = f"{namespace}/{name}"
    if type == "DELETED":
        _deployments_seen.forget(key)
    elif not _deployments_seen.changed(key, deployment_fingerprint(body)):
        return  # only the controller's bookkeeping changed
    _mdep_pass(namespace, labels[LABEL_MDEP], wait=False)


@kopf.on.event("v1", "services", labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
@kopf.on.event("policy", "v1", "poddisruptionbudgets",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
def owned_fixed_child_event(type: str | None, namespace: str | None, name: str, labels: Mapping[str, str],  # noqa: A002
                            body: Any, **_: Any) -> None:
    """Our Service or PodDisruptionBudget deleted or edited by someone: apply them again (they are otherwise
    applied once per process)."""
    if type is None:
        return  # the initial listing: nothing changed
    namespace = namespaced(namespace)
    mdep = labels[LABEL_MDEP]
    if type == "DELETED" or (body.get("metadata") or {}).get("deletionTimestamp") or \
            not _fixed_child_intact(body, namespace, mdep):
        _fixed_applied.forget(namespace, mdep)
        _mdep_pass(namespace, mdep, wait=False)


def _fixed_child_intact(body: Any, namespace: str, mdep: str) -> bool:
    owner = next((o for o in (body.get("metadata") or {}).get("ownerReferences") or ()
                  if o.get("kind") == "ModelDeployment"), None)
    if owner is None:
        return False
    built = next((b for b in fixed_children({"apiVersion": owner["apiVersion"], "kind": "ModelDeployment",
                                             "metadata": {"name": mdep, "namespace": namespace, "uid": owner["uid"]}})
                  if b["kind"] == body.get("kind")), None)
    return built is not None and covers(body, built)


# What ModelDeployments refer to, kept from the watches (refs.py): no read of them per reconcile.
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors")
def flavor_event(type: str | None, name: str, body: Any, **_: Any) -> None:  # noqa: A002 (kopf's name)
    if type == "DELETED":
        refs().gone(WatchedRefs.FLAVOR, name)
    else:
        refs().seen(WatchedRefs.FLAVOR, name, dict(body.get("spec") or {}))


@kopf.on.event("v1", "namespaces")
def namespace_event(type: str | None, name: str, labels: Mapping[str, str], **_: Any) -> None:  # noqa: A002
    if type == "DELETED":
        refs().gone(WatchedRefs.NAMESPACE, name)
    else:
        refs().seen(WatchedRefs.NAMESPACE, name, labels.get(LABEL_TENANT))


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "localqueues")
def local_queue_event(type: str | None, namespace: str | None, name: str, **_: Any) -> None:  # noqa: A002
    if type == "DELETED":
        refs().gone(WatchedRefs.QUEUE, f"{namespace}/{name}")
    else:
        refs().seen(WatchedRefs.QUEUE, f"{namespace}/{name}", True)


@kopf.on.event("rbac.authorization.k8s.io", "v1", "rolebindings")
@kopf.on.event("rbac.authorization.k8s.io", "v1", "roles")
def namespace_rbac_event(type: str | None, namespace: str | None, **_: Any) -> None:  # noqa: A002 (kopf's name)
    """A Role or RoleBinding changed: what the gateway may read there may have too. Its models whose engines want
    their own key get a pass (their GatewayKeyAccess condition)."""
    if type is not None:  # None: the initial listing (every model gets a pass on resume)
        _key_access_passes(namespaced(namespace))


@kopf.on.event("rbac.authorization.k8s.io", "v1", "clusterrolebindings")
@kopf.on.event("rbac.authorization.k8s.io", "v1", "clusterroles")
def cluster_rbac_event(type: str | None, **_: Any) -> None:  # noqa: A002 (kopf's name)
    """A ClusterRole or ClusterRoleBinding changed: it can grant Secret reads in every namespace, so every model
    whose engines want their own key gets a pass."""
    if type is not None:
        _key_access_passes(None)


def _key_access_passes(namespace: str | None) -> None:
    """A pass for each model of `namespace` (None: of every namespace) whose engines want their own key."""
    if config().gateway is None:
        return  # no gateway to ask about
    where = namespace or "all namespaces"
    try:
        mdeps = kube().list(API_VERSION, MDEP_PLURAL, namespace)
    except (KubeError, httpx.TransportError) as exc:
        log.warning("models of %s not listed after an RBAC change: %s", where, exc)
        return
    keyed = [(m["metadata"]["namespace"], m["metadata"]["name"])
             for m in mdeps if (m.get("spec") or {}).get("apiKeySecretRef")]
    if keyed:
        log.info("rbac changed ns=%s: checking the gateway's key access of %s", where,
                 [f"{ns}/{name}" for ns, name in keyed])
    for ns, name in keyed:
        _mdep_pass(ns, name, wait=False)


@kopf.on.create(GROUP, VERSION, TENANT_PLURAL)
@kopf.on.update(GROUP, VERSION, TENANT_PLURAL)
@kopf.on.resume(GROUP, VERSION, TENANT_PLURAL)
def tenant_changed(name: str, **_: Any) -> None:
    _tenant_pass(name, converge=True, wait=True)


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_TENANT: kopf.PRESENT})
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "localqueues",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_TENANT: kopf.PRESENT})
def tenant_queue_event(type: str | None, labels: Mapping[str, str], **_: Any) -> None:  # noqa: A002 (kopf's name)
    """A queue of a tenant was deleted by someone: put it back (self-healing without a timer)."""
    if type == "DELETED":
        _tenant_pass(labels[LABEL_TENANT], converge=True, wait=False)
