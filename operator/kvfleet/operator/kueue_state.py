"""Reading Kueue Workloads (v1beta2) into plain facts: admitted, evicted, flavor, Kueue's message."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .constants import GPU_RESOURCE, LABEL_ORDINAL, LABEL_WORKLOAD_HASH


@dataclass(frozen=True)
class ObservedWorkload:
    name: str
    ordinal: int | None
    spec_hash: str | None
    admitted: bool
    evicted: bool
    terminating: bool
    active: bool
    flavor: str | None
    gpus: int
    pending_reason: str | None = None
    pending_message: str | None = None

    @property
    def running_allowed(self) -> bool:
        """A pod may exist for this replica only while Kueue holds it admitted."""
        return self.admitted and not self.evicted and not self.terminating and self.active


def condition(obj: Mapping[str, Any], cond_type: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or ():
        if c.get("type") == cond_type:
            return c
    return None


def is_true(obj: Mapping[str, Any], cond_type: str) -> bool:
    c = condition(obj, cond_type)
    return c is not None and c.get("status") == "True"


def quantity_to_int(value: Any) -> int:
    """GPU counts are whole numbers; Kueue writes them as strings ("4") or ints."""
    if value is None:
        return 0
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        return int(float(text.rstrip("k")) * (1000 if text.endswith("k") else 1))


def requested_gpus(wl: Mapping[str, Any]) -> int:
    """GPUs the workload asks for: per pod set, sum over containers times the pod count."""
    total = 0
    for ps in (wl.get("spec") or {}).get("podSets") or ():
        per_pod = sum(quantity_to_int(((c.get("resources") or {}).get("requests") or {}).get(GPU_RESOURCE))
                      for c in ((ps.get("template") or {}).get("spec") or {}).get("containers") or ())
        total += per_pod * int(ps.get("count", 1))
    return total


def assigned_flavor(wl: Mapping[str, Any]) -> str | None:
    """The ResourceFlavor Kueue assigned to the GPU (or, failing that, any resource)."""
    admission = (wl.get("status") or {}).get("admission") or {}
    for psa in admission.get("podSetAssignments") or ():
        flavors = psa.get("flavors") or {}
        if flavors.get(GPU_RESOURCE):
            return flavors[GPU_RESOURCE]
        if flavors:
            return next(iter(flavors.values()))
    return None


def observe_workload(wl: Mapping[str, Any]) -> ObservedWorkload:
    meta = wl.get("metadata") or {}
    labels = meta.get("labels") or {}
    ordinal_text = labels.get(LABEL_ORDINAL)
    status = wl.get("status") or {}
    admitted = is_true(wl, "Admitted") and bool(status.get("admission"))
    pending = condition(wl, "QuotaReserved")
    pending_reason = pending_message = None
    if not admitted and pending is not None and pending.get("status") == "False":
        pending_reason, pending_message = pending.get("reason"), pending.get("message")
    return ObservedWorkload(
        name=meta.get("name", ""),
        ordinal=int(ordinal_text) if ordinal_text and ordinal_text.isdigit() else None,
        spec_hash=labels.get(LABEL_WORKLOAD_HASH),
        admitted=admitted,
        evicted=is_true(wl, "Evicted") or is_true(wl, "Preempted"),
        terminating=bool(meta.get("deletionTimestamp")),
        active=(wl.get("spec") or {}).get("active", True) is not False,
        flavor=assigned_flavor(wl),
        gpus=requested_gpus(wl),
        pending_reason=pending_reason,
        pending_message=pending_message,
    )
