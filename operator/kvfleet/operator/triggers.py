"""Which events of owned objects are worth a reconcile: only those that change what the reconcile reads from them.

A Deployment's status is rewritten by its controller many times on the way to Ready (observedGeneration, updated,
available replicas, conditions...), a Workload's by Kueue (conditions, requeue state); the ModelDeployment's plan
and status read a few fields of each. Remembering those fields per object (pure fingerprints) and reconciling only
when they change cuts the reconciles per replica several times, with the same outcome.
"""
from __future__ import annotations

import threading
from typing import Any, Hashable, Mapping

from .constants import LABEL_FLAVOR, LABEL_WORKLOAD_HASH
from .kueue_state import observe_workload


def workload_fingerprint(body: Mapping[str, Any]) -> Hashable:
    """What the plan and the tenant's usage read: admission, eviction, flavor, Kueue's message, hash, deletion."""
    return observe_workload(body)


def deployment_fingerprint(body: Mapping[str, Any]) -> Hashable:
    """What the plan and the status read: shape labels, wanted replicas, pods and ready pods, deletion; and the
    generation, which any change of the spec bumps (someone's edit of the template: the reconcile puts ours back)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = body.get("status") or {}
    return (labels.get(LABEL_FLAVOR), labels.get(LABEL_WORKLOAD_HASH), (body.get("spec") or {}).get("replicas"),
            status.get("replicas"), status.get("readyReplicas"), bool(meta.get("deletionTimestamp")),
            meta.get("generation"))


class Fingerprints:
    """The last fingerprint seen per object (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, Hashable] = {}

    def changed(self, key: str, fingerprint: Hashable) -> bool:
        """Records `fingerprint`; True when it differs from the last one (or the object is new to us)."""
        with self._lock:
            if key in self._seen and self._seen[key] == fingerprint:
                return False
            self._seen[key] = fingerprint
            return True

    def forget(self, key: str) -> None:
        with self._lock:
            self._seen.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
