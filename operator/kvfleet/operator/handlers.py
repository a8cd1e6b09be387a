"""kopf handlers: thin edges that call the reconcilers, serialised per object.

ModelDeployments are reconciled on create/update/resume and on any event of a Workload or
Deployment they own. Tenants on create/update/resume, when one of their queues is deleted,
and (status only) when a workload in their namespaces changes. No timers, so no finalizers:
deleting a ModelDeployment or a Tenant never waits for the operator.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping

import httpx
import kopf

from . import metrics
from .config import OperatorConfig
from .constants import (
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
from .reconcile import reconcile_model_deployment
from .reconcile_tenant import reconcile_tenant

log = logging.getLogger("kvfleet.operator.handlers")

_state_lock = threading.Lock()
_locks: dict[str, threading.Lock] = {}
_kube: Kube | None = None
_config: OperatorConfig | None = None


def kube() -> Kube:
    global _kube
    with _state_lock:
        if _kube is None:
            _kube = Kube.from_kubeconfig()
        return _kube


def config() -> OperatorConfig:
    global _config
    with _state_lock:
        if _config is None:
            _config = OperatorConfig.from_env()
        return _config


def _lock(key: str) -> threading.Lock:
    with _state_lock:
        return _locks.setdefault(key, threading.Lock())


def _guarded(kind: str, key: str, fn: Callable[[], Any]) -> Any:
    """One reconcile per object at a time; API errors become kopf retries."""
    with _lock(key), metrics.timed(kind):
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
    """Reconcile, then mirror the status counts in the replica gauges (inside the object's lock, so a
    reconcile that ends after the object's deletion cannot bring its series back)."""
    status = reconcile_model_deployment(kube(), config(), namespace, name)
    if status is None:
        metrics.REPLICAS.forget(namespace, name)
    else:
        metrics.REPLICAS.record(namespace, name, status)
    return status


def namespaced(namespace: str | None) -> str:
    """kopf types a handler's namespace as optional; every object these handlers watch is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object came without a namespace")
    return namespace


def reconcile_now(namespace: str, name: str) -> Any:
    """Reconcile one ModelDeployment now (the autoscaler calls this after a decision)."""
    return _guarded("ModelDeployment", f"{namespace}/{name}", lambda: _reconcile_and_record(namespace, name))


@kopf.on.create(GROUP, VERSION, MDEP_PLURAL)
@kopf.on.update(GROUP, VERSION, MDEP_PLURAL)
@kopf.on.resume(GROUP, VERSION, MDEP_PLURAL)
def mdep_changed(namespace: str | None, name: str, **_: Any) -> None:
    namespace = namespaced(namespace)
    status = reconcile_now(namespace, name)
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
        with _lock(f"{namespace}/{name}"):
            metrics.REPLICAS.forget(namespace, name)


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloads",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
def owned_workload_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    namespace = namespaced(namespace)
    reconcile_now(namespace, labels[LABEL_MDEP])
    # Admission changed the tenant's GPU usage: refresh its status now.
    ns = kube().get("v1", "namespaces", namespace) or {}
    tenant = ((ns.get("metadata") or {}).get("labels") or {}).get(LABEL_TENANT)
    if tenant:
        _guarded("Tenant", tenant, lambda: reconcile_tenant(kube(), tenant, converge=False,
                                                            system_namespaces=config().system_namespaces))


@kopf.on.event("apps", "v1", "deployments",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_MDEP: kopf.PRESENT})
def owned_deployment_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    reconcile_now(namespaced(namespace), labels[LABEL_MDEP])


@kopf.on.create(GROUP, VERSION, TENANT_PLURAL)
@kopf.on.update(GROUP, VERSION, TENANT_PLURAL)
@kopf.on.resume(GROUP, VERSION, TENANT_PLURAL)
def tenant_changed(name: str, **_: Any) -> None:
    _guarded("Tenant", name, lambda: reconcile_tenant(kube(), name,
                                                        system_namespaces=config().system_namespaces))


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_TENANT: kopf.PRESENT})
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "localqueues",
               labels={LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_TENANT: kopf.PRESENT})
def tenant_queue_event(type: str | None, labels: Mapping[str, str], **_: Any) -> None:  # noqa: A002 (kopf's name)
    """A queue of a tenant was deleted by someone: put it back (self-healing without a timer)."""
    if type == "DELETED":
        tenant = labels[LABEL_TENANT]
        _guarded("Tenant", tenant, lambda: reconcile_tenant(
            kube(), tenant, system_namespaces=config().system_namespaces))
