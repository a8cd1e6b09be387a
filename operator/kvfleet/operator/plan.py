"""The pure plan: desired replicas vs observed Workloads -> what to create, delete and run.

Rules (each replica is one Workload named `<mdep>-<ordinal>`):
- ordinals >= desired are deleted at once (scale-down frees quota immediately);
- an evicted or preempted workload is deleted and, once gone, recreated to queue again;
- a workload whose immutable part changed (resources, queue, priority) is replaced: at once
  while pending, one at a time while admitted (a rolling replacement);
- a missing ordinal below desired is created, unless its old workload is still terminating;
- one Deployment per shape (assigned flavor, workload hash) runs exactly the workloads admitted with that
  flavor and that hash: a pod never asks for more than the workload Kueue admitted for it, even while a
  change of resources rolls through.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .kueue_state import ObservedWorkload


@dataclass(frozen=True)
class WorkloadPlan:
    create: tuple[int, ...] = ()
    delete: tuple[str, ...] = ()
    # (flavor, workload hash) -> admitted workloads of that shape
    admitted_by_shape: dict[tuple[str, str], int] = field(default_factory=dict)
    pending: tuple[ObservedWorkload, ...] = ()

    @property
    def admitted(self) -> int:
        return sum(self.admitted_by_shape.values())

    @property
    def admitted_by_flavor(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (flavor, _), n in self.admitted_by_shape.items():
            out[flavor] = out.get(flavor, 0) + n
        return out


def shape_of(w: ObservedWorkload) -> tuple[str, str]:
    return (w.flavor or "default", w.spec_hash or "")


def _count_shapes(workloads: Iterable[ObservedWorkload]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for w in workloads:
        out[shape_of(w)] = out.get(shape_of(w), 0) + 1
    return out


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
    pending = tuple(w for w in kept if not w.running_allowed)
    return WorkloadPlan(create=create, delete=tuple(delete),
                        admitted_by_shape=_count_shapes(w for w in kept if w.running_allowed), pending=pending)


def _is_scale_down(name: str, live: Iterable[ObservedWorkload], desired: int) -> bool:
    return any(w.name == name and (w.ordinal is None or w.ordinal >= desired) for w in live)


def plan_deployment_replicas(admitted_by_shape: dict[tuple[str, str], int],
                             existing_shapes: Iterable[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """Replicas per shape's Deployment; a shape that lost all its workloads goes to 0."""
    replicas = {shape: 0 for shape in existing_shapes}
    replicas.update(admitted_by_shape)
    return dict(sorted(replicas.items()))


def frozen_plan(desired: int, observed: Sequence[ObservedWorkload]) -> WorkloadPlan:
    """The plan while the spec can't be acted on (unknown flavor, queue...): change no workload,
    keep running what Kueue admitted."""
    live = [w for w in observed if not w.terminating]
    running = [w for w in live if w.running_allowed and w.ordinal is not None and w.ordinal < desired]
    pending = tuple(w for w in live if not w.running_allowed)
    return WorkloadPlan(admitted_by_shape=_count_shapes(running), pending=pending)
