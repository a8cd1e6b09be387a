"""Watching one tenant's replicas through control-plane restarts: a sampler thread that reads, over and over, what
is admitted and what runs, and checks each sample against the tenant's quota at that moment; and the pure
checks of a converged state (no duplicate workloads, no orphaned pods or Deployments).

A sample the apiserver cannot answer (it or etcd is down) is a gap: recorded, never counted as a pass.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.operator.kube import Kube

KUEUE = "kueue.x-k8s.io/v1beta2"
GPU = "nvidia.com/gpu"
LABEL_MDEP = "serving.kvfleet.dev/modeldeployment"
LABEL_ORDINAL = "serving.kvfleet.dev/replica"


def _true(obj: Mapping[str, Any], cond_type: str) -> bool:
    return any(c.get("type") == cond_type and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or ())


def workload_gpus(wl: Mapping[str, Any]) -> int:
    total = 0
    for ps in (wl.get("spec") or {}).get("podSets") or ():
        for c in ((ps.get("template") or {}).get("spec") or {}).get("containers") or ():
            total += int(((c.get("resources") or {}).get("requests") or {}).get(GPU, 0)) * int(ps.get("count", 1))
    return total


def pod_gpus(pod: Mapping[str, Any]) -> int:
    return sum(int(((c.get("resources") or {}).get("requests") or {}).get(GPU, 0))
               for c in (pod.get("spec") or {}).get("containers") or ())


def holds_gpus(pod: Mapping[str, Any]) -> bool:
    """A pod bound to a node and not finished holds its GPUs, terminating or not (until it is gone)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def is_admitted(wl: Mapping[str, Any]) -> bool:
    """Quota held: admitted (or reserved) and not finished; an evicted workload holds it until Kueue clears it."""
    return (_true(wl, "Admitted") or _true(wl, "QuotaReserved")) and not _true(wl, "Finished")


@dataclass(frozen=True)
class Sample:
    t0: float  # monotonic, when the reads began
    t1: float  # when they ended
    admitted_gpus: int
    running_gpus: int
    workloads: int
    duplicate_ordinals: tuple[str, ...]


@dataclass(frozen=True)
class Gap:
    t0: float
    t1: float
    error: str


@dataclass
class QuotaTimeline:
    """The tenant's GPU quota over time, as the test changed it: (monotonic time it was sent, GPUs)."""

    changes: list[tuple[float, int]] = field(default_factory=list)

    def set(self, gpus: int) -> None:
        self.changes.append((time.monotonic(), gpus))

    def bound(self, t0: float, t1: float) -> int:
        """The most the quota allowed at any moment of [t0, t1] (a raise counts from when it was sent)."""
        in_force = [g for t, g in self.changes if t <= t0][-1:]
        during = [g for t, g in self.changes if t0 < t <= t1]
        return max(in_force + during)


def read_sample(kube: Kube, namespace: str) -> Sample:
    t0 = time.monotonic()
    wls = kube.list(KUEUE, "workloads", namespace)
    pods = kube.list("v1", "pods", namespace)
    t1 = time.monotonic()
    ordinals: dict[str, list[str]] = {}
    for w in wls:
        key = f"{(w['metadata'].get('labels') or {}).get(LABEL_MDEP)}/" \
              f"{(w['metadata'].get('labels') or {}).get(LABEL_ORDINAL)}"
        ordinals.setdefault(key, []).append(w["metadata"]["name"])
    return Sample(
        t0=t0, t1=t1,
        admitted_gpus=sum(workload_gpus(w) for w in wls if is_admitted(w)),
        running_gpus=sum(pod_gpus(p) for p in pods if holds_gpus(p)),
        workloads=len(wls),
        duplicate_ordinals=tuple(k for k, names in ordinals.items() if len(names) > 1),
    )


class Sampler(threading.Thread):
    """Samples one namespace every `interval` seconds until stopped; keeps samples and gaps."""

    def __init__(self, kube: Kube, namespace: str, quota: QuotaTimeline, interval: float = 0.2) -> None:
        super().__init__(daemon=True, name=f"sampler {namespace}")
        self.kube, self.namespace, self.quota, self.interval = kube, namespace, quota, interval
        self.samples: list[Sample] = []
        self.gaps: list[Gap] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                s = read_sample(self.kube, self.namespace)
            except Exception as exc:  # the apiserver or etcd is down: a gap, not a pass
                with self._lock:
                    self.gaps.append(Gap(t0, time.monotonic(), type(exc).__name__))
            else:
                with self._lock:
                    self.samples.append(s)
            self.stopping.wait(self.interval)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)

    def wait_sample_after(self, t: float, timeout: float = 30.0) -> bool:
        """Wait (bounded) until a sample has begun after `t`; False if none did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.samples and self.samples[-1].t0 > t:
                    return True
            time.sleep(self.interval / 2)
        return False

    def between(self, t0: float, t1: float) -> tuple[list[Sample], list[Gap]]:
        with self._lock:
            return ([s for s in self.samples if t0 <= s.t0 <= t1], [g for g in self.gaps if t0 <= g.t0 <= t1])


def violations(samples: Sequence[Sample], quota: QuotaTimeline) -> list[str]:
    """Every sample where more GPUs were admitted or held by pods than the quota allowed, or an ordinal had
    two workloads."""
    out = []
    for s in samples:
        bound = quota.bound(s.t0, s.t1)
        if s.admitted_gpus > bound:
            out.append(f"t={s.t0:.1f}: {s.admitted_gpus} GPUs admitted, quota {bound}")
        if s.running_gpus > bound:
            out.append(f"t={s.t0:.1f}: pods hold {s.running_gpus} GPUs, quota {bound}")
        if s.duplicate_ordinals:
            out.append(f"t={s.t0:.1f}: duplicate workloads for {', '.join(s.duplicate_ordinals)}")
    return out


def outage_seconds(samples: Sequence[Sample], gaps: Sequence[Gap]) -> float:
    """Seconds the namespace could not be read: each run of failed reads with no successful one in between counts
    from its first failure's start to its last failure's end."""
    events = sorted([(g.t0, g.t1, True) for g in gaps] + [(s.t0, s.t1, False) for s in samples])
    total, run_start, run_end = 0.0, None, 0.0
    for t0, t1, failed in events:
        if failed:
            run_start = t0 if run_start is None else run_start
            run_end = t1
        elif run_start is not None:
            total += run_end - run_start
            run_start = None
    if run_start is not None:
        total += run_end - run_start
    return total


@dataclass(frozen=True)
class Expect:
    """A converged ModelDeployment of one-GPU replicas."""

    desired: int
    admitted: int


def convergence_problems(expect: Expect, mdep: Mapping[str, Any] | None, workloads: Sequence[Mapping[str, Any]],
                         deployments: Sequence[Mapping[str, Any]], replicasets: Sequence[Mapping[str, Any]],
                         pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """What still differs from `expect` (empty: converged): the status, one workload per ordinal below desired,
    one Deployment (owned by the ModelDeployment) asking for exactly the admitted replicas, and every pod owned by a
    live ReplicaSet of a live Deployment (no orphan), as many as admitted, all Ready."""
    problems = []
    if mdep is None:
        return ["the ModelDeployment is gone"]
    name = mdep["metadata"]["name"]
    st = mdep.get("status") or {}
    if st.get("observedGeneration") != mdep["metadata"].get("generation"):
        problems.append("status not of the current generation")
    got = (st.get("desiredReplicas"), st.get("admittedReplicas"), st.get("readyReplicas"))
    want_counts = (expect.desired, expect.admitted, expect.admitted)
    if got != want_counts:
        problems.append(f"status desired/admitted/ready {got}, want {want_counts}")
    live = [w for w in workloads if not w["metadata"].get("deletionTimestamp")]
    names = sorted(w["metadata"]["name"] for w in live)
    want = sorted(f"{name}-{i}" for i in range(expect.desired))
    if names != want:
        problems.append(f"workloads {names}, want {want}")
    if sum(1 for w in live if is_admitted(w)) != expect.admitted:
        problems.append(f"{sum(1 for w in live if is_admitted(w))} workloads admitted, want {expect.admitted}")
    # One flavor and one workload shape: one Deployment, owned by the live ModelDeployment (none left over).
    mdep_uid = mdep["metadata"].get("uid")
    if len(deployments) != 1 or not all(
            any(o.get("uid") == mdep_uid for o in d["metadata"].get("ownerReferences") or ()) for d in deployments):
        problems.append(f"Deployments {[d['metadata']['name'] for d in deployments]}, want one owned by {name}")
    asked = sum(int((d.get("spec") or {}).get("replicas") or 0) for d in deployments)
    if asked != expect.admitted:
        problems.append(f"Deployments ask for {asked} pods, want {expect.admitted}")
    dep_uids = {d["metadata"]["uid"] for d in deployments}
    rs_uids = {rs["metadata"]["uid"] for rs in replicasets
               if any(o.get("uid") in dep_uids for o in rs["metadata"].get("ownerReferences") or ())}
    present = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    orphans = [p["metadata"]["name"] for p in pods
               if not any(o.get("uid") in rs_uids for o in p["metadata"].get("ownerReferences") or ())]
    if orphans:
        problems.append(f"pods without a live ReplicaSet of a live Deployment: {orphans}")
    if len(present) != expect.admitted or not all(_true(p, "Ready") for p in present):
        problems.append(f"{len(present)} pods ({sum(_true(p, 'Ready') for p in present)} Ready), "
                        f"want {expect.admitted} Ready")
    if len(pods) != len(present):
        problems.append(f"{len(pods) - len(present)} pods still terminating")
    return problems
