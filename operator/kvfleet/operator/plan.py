"""The pure plan: desired replicas vs observed Workloads -> what to create, delete and run.

Rules (each replica is one Workload named `<mdep>-<ordinal>`):
- ordinals >= desired are deleted at once (scale-down frees quota immediately);
- an evicted or preempted workload is deleted and, once gone, recreated to queue again;
- a workload whose immutable part changed (resources, queue, priority) is replaced: at once
  while pending, one at a time while admitted (a rolling replacement);
- a missing ordinal below desired is created, unless its old workload is still terminating;
- each flavor's Deployment runs exactly the workloads admitted with that flavor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .kueue_state import ObservedWorkload


@dataclass(frozen=True)
class WorkloadPlan:
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    admitted_by_flavor: dict[str, int] = field(default_factory=dict)
    pending: tuple[ObservedWorkload, ...] = ()

    @property
    def admitted(self) -> int:
        return sum(self.admitted_by_flavor.values())


def plan_workloads(desired: int, observed: Sequence[ObservedWorkload], spec_hash: str) -> WorkloadPlan:
    if desired < 0:
        raise ValueError(f"desired replicas must be >= 0, got {desired}")
    live = [w for w in observed if not w.terminating]
    taken = {w.ordinal for w in observed if w.ordinal is not None}
    delete: list[str] = []
    kept: list[ObservedWorkload] = []
    stale_admitted: list[ObservedWorkload] = []
    for w in sorted(live, key=lambda w: (w.ordinal is None, w.ordinal or 0, w.name)):
        if w.ordinal is None or w.ordinal >= desired:
            delete.append(w.name)
        elif w.evicted:
            delete.append(w.name)
        elif w.spec_hash != spec_hash and not w.running_allowed:
            delete.append(w.name)
        else:
            kept.append(w)
            if w.spec_hash != spec_hash:
                stale_admitted.append(w)
    rolling_busy = any(w.terminating for w in observed) or any(
        n for n in delete if not _is_scale_down(n, live, desired))
    if stale_admitted and not rolling_busy:
        first = stale_admitted[0]
        delete.append(first.name)
        kept.remove(first)
    create = tuple(i for i in range(desired) if i not in taken)
    admitted_by_flavor: dict[str, int] = {}
    for w in kept:
        if w.running_allowed:
            flavor = w.flavor or "default"
            admitted_by_flavor[flavor] = admitted_by_flavor.get(flavor, 0) + 1
    pending = tuple(w for w in kept if not w.running_allowed)
    return WorkloadPlan(create=create, delete=tuple(delete), admitted_by_flavor=admitted_by_flavor,
                        pending=pending)


def _is_scale_down(name: str, live: Iterable[ObservedWorkload], desired: int) -> bool:
    return any(w.name == name and (w.ordinal is None or w.ordinal >= desired) for w in live)


def plan_deployment_replicas(admitted_by_flavor: dict[str, int], existing_flavors: Iterable[str]) -> dict[str, int]:
    """Replicas per flavor Deployment; a flavor that lost all its workloads goes to 0."""
    replicas = {flavor: 0 for flavor in existing_flavors}
    replicas.update(admitted_by_flavor)
    return dict(sorted(replicas.items()))


def frozen_plan(desired: int, observed: Sequence[ObservedWorkload]) -> WorkloadPlan:
    """The plan while the spec can't be acted on (unknown flavor, queue...): change no workload,
    keep running what Kueue admitted."""
    admitted_by_flavor: dict[str, int] = {}
    pending = []
    for w in observed:
        if w.terminating:
            continue
        if w.running_allowed and w.ordinal is not None and w.ordinal < desired:
            flavor = w.flavor or "default"
            admitted_by_flavor[flavor] = admitted_by_flavor.get(flavor, 0) + 1
        elif not w.running_allowed:
            pending.append(w)
    return WorkloadPlan(admitted_by_flavor=admitted_by_flavor, pending=tuple(pending))
