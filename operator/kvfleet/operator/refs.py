"""What a ModelDeployment refers to (ResourceFlavors, its namespace's tenant, LocalQueues, priority classes),
looked up for each reconcile.

`ApiRefs` asks the apiserver every time. `WatchedRefs` keeps the flavors, namespaces and LocalQueues the operator's
watches deliver (kopf event handlers call `seen`/`gone`) and answers from memory; a miss, or an answer that would
stop the reconcile (no such flavor, no tenant, no queue), is read through to the apiserver before it is believed, so
the memory never makes a ModelDeployment fail that a fresh read would let through (at start-up, before the watches
have listed, everything is a miss). Only the watches write the memory.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping, Protocol

from .constants import KUEUE_API_VERSION, LABEL_TENANT
from .kube import Kube


class Refs(Protocol):
    def flavor(self, name: str) -> Mapping[str, Any] | None:
        """The ResourceFlavor's spec, None when it does not exist."""

    def namespace_tenant(self, namespace: str) -> str | None:
        """The Tenant whose label the namespace carries (None: none, or no such namespace)."""

    def local_queue_exists(self, namespace: str, name: str) -> bool:
        ...

    def priority_value(self, name: str) -> int | None:
        """The WorkloadPriorityClass' value, None when it does not exist."""


def _tenant_of(ns: Mapping[str, Any] | None) -> str | None:
    return ((ns or {}).get("metadata") or {}).get("labels", {}).get(LABEL_TENANT) if ns else None


class ApiRefs:
    """Every lookup a read from the apiserver."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def flavor(self, name: str) -> Mapping[str, Any] | None:
        obj = self.kube.get(KUEUE_API_VERSION, "resourceflavors", name)
        return None if obj is None else (obj.get("spec") or {})

    def namespace_tenant(self, namespace: str) -> str | None:
        return _tenant_of(self.kube.get("v1", "namespaces", namespace))

    def local_queue_exists(self, namespace: str, name: str) -> bool:
        return self.kube.get(KUEUE_API_VERSION, "localqueues", name, namespace) is not None

    def priority_value(self, name: str) -> int | None:
        obj = self.kube.get(KUEUE_API_VERSION, "workloadpriorityclasses", name)
        return None if obj is None else int(obj.get("value", 0))


class WatchedRefs:
    """Answers from what the watches delivered; misses and negative answers are read through (`ApiRefs`)."""

    FLAVOR, NAMESPACE, QUEUE = "flavor", "namespace", "queue"

    def __init__(self, api: ApiRefs) -> None:
        self.api = api
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], Any] = {}

    # --- fed by the watches (kopf event handlers) ----------------------------------------------------------
    def seen(self, kind: str, key: str, value: Any) -> None:
        with self._lock:
            self._known[(kind, key)] = value

    def gone(self, kind: str, key: str) -> None:
        with self._lock:
            self._known.pop((kind, key), None)

    def _get(self, kind: str, key: str) -> tuple[bool, Any]:
        with self._lock:
            k = (kind, key)
            return (k in self._known, self._known.get(k))

    # --- lookups ---------------------------------------------------------------------------------------------
    def flavor(self, name: str) -> Mapping[str, Any] | None:
        hit, spec = self._get(self.FLAVOR, name)
        # Only the watch fills the memory: a read-through answer stored here could outlive a deletion the
        # watch already reported.
        return spec if hit else self.api.flavor(name)

    def namespace_tenant(self, namespace: str) -> str | None:
        hit, tenant = self._get(self.NAMESPACE, namespace)
        if hit and tenant:
            return str(tenant)
        return self.api.namespace_tenant(namespace)  # not (yet) a tenant's: ask before saying so

    def local_queue_exists(self, namespace: str, name: str) -> bool:
        hit, _ = self._get(self.QUEUE, f"{namespace}/{name}")
        return hit or self.api.local_queue_exists(namespace, name)

    def priority_value(self, name: str) -> int | None:
        return self.api.priority_value(name)  # rare: read each time
