"""Kubernetes Events (core/v1) about our objects: built purely, posted by the caller."""
from __future__ import annotations

import socket
from typing import Any, Mapping

from .constants import MANAGED_BY_VALUE


def build_event(obj: Mapping[str, Any], event_type: str, reason: str, message: str, now: str) -> dict[str, Any]:
    meta = obj["metadata"]
    namespace = meta.get("namespace") or "default"  # events about cluster-scoped objects live in default
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
        "involvedObject": {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": meta["name"],
                           "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "type": event_type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": MANAGED_BY_VALUE},
        "reportingComponent": MANAGED_BY_VALUE,
        "reportingInstance": socket.gethostname()[:128],
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
