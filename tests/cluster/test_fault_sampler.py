"""The pure checks of the control-plane fault e2e (e2e/fault_sampler.py): quota bounds over time, violations,
unreadable time, and what a converged ModelDeployment is."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))

from fault_sampler import (  # noqa: E402
    Expect,
    Gap,
    QuotaTimeline,
    Sample,
    convergence_problems,
    outage_seconds,
    violations,
)


def sample(t: float, admitted: int, running: int, dup: tuple[str, ...] = ()) -> Sample:
    return Sample(t0=t, t1=t + 0.05, admitted_gpus=admitted, running_gpus=running, workloads=admitted,
                  duplicate_ordinals=dup)


def test_a_sample_is_held_to_the_highest_quota_in_force_during_it() -> None:
    quota = QuotaTimeline([(0.0, 4), (10.0, 2)])
    assert quota.bound(5.0, 5.1) == 4 and quota.bound(9.99, 10.01) == 4 and quota.bound(11.0, 11.1) == 2
    assert violations([sample(5, 4, 4), sample(11, 2, 2)], quota) == []
    found = violations([sample(11, 3, 2), sample(12, 2, 3), sample(13, 2, 2, ("svc/1",))], quota)
    assert len(found) == 3 and "admitted" in found[0] and "pods hold" in found[1] and "duplicate" in found[2]


def test_unreadable_time_runs_from_the_first_failed_read_to_the_last_before_a_success() -> None:
    gaps = [Gap(1.0, 1.1, "ConnectError"), Gap(1.3, 1.4, "ConnectError"), Gap(5.0, 5.5, "ReadTimeout")]
    assert abs(outage_seconds([sample(0, 0, 0), sample(2, 0, 0), sample(6, 0, 0)], gaps) - 0.9) < 1e-9
    assert outage_seconds([sample(0, 0, 0)], []) == 0.0


def converged_objects() -> dict[str, Any]:
    mdep = {"metadata": {"name": "svc", "uid": "m", "generation": 2},
            "status": {"observedGeneration": 2, "desiredReplicas": 2, "admittedReplicas": 1, "readyReplicas": 1}}
    admitted = {"type": "Admitted", "status": "True"}
    workloads = [{"metadata": {"name": "svc-0"}, "status": {"conditions": [admitted]}},
                 {"metadata": {"name": "svc-1"}, "status": {}}]
    deployment = {"metadata": {"name": "svc-h200", "uid": "d", "ownerReferences": [{"uid": "m"}]},
                  "spec": {"replicas": 1}}
    replicaset = {"metadata": {"uid": "r", "ownerReferences": [{"uid": "d"}]}}
    pod = {"metadata": {"name": "p", "ownerReferences": [{"uid": "r"}]},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    return {"mdep": mdep, "workloads": workloads, "deployments": [deployment], "replicasets": [replicaset],
            "pods": [pod]}


def test_converged_means_one_workload_per_replica_one_owned_deployment_and_no_orphan() -> None:
    o = converged_objects()
    assert convergence_problems(Expect(desired=2, admitted=1), **o) == []
    twice = {**o, "workloads": [*o["workloads"], {"metadata": {"name": "svc-0"}, "status": {}}]}
    assert any("workloads" in p for p in convergence_problems(Expect(2, 1), **twice))
    stray = {"metadata": {"name": "old", "uid": "d2", "ownerReferences": [{"uid": "gone"}]}, "spec": {"replicas": 0}}
    assert any("Deployments" in p for p in convergence_problems(Expect(2, 1), **{**o, "deployments": [
        *o["deployments"], stray]}))
    orphan = {"metadata": {"name": "q", "ownerReferences": [{"uid": "old-rs"}]}, "status": {}}
    assert any("without a live ReplicaSet" in p for p in convergence_problems(Expect(2, 1), **{
        **o, "pods": [*o["pods"], orphan]}))
    assert convergence_problems(Expect(2, 1), **{**o, "mdep": None}) == ["the ModelDeployment is gone"]
