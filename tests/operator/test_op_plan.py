"""The pure plan: workloads to create/delete and Deployment replicas per flavor."""
from __future__ import annotations

import pytest

from kvfleet.operator.kueue_state import observe_workload
from kvfleet.operator.plan import frozen_plan, plan_deployment_replicas, plan_workloads

from op_factories import make_workload


def obs(*wls):
    return [observe_workload(w) for w in wls]


def test_fresh_creates_one_workload_per_replica() -> None:
    plan = plan_workloads(3, [], "h")
    assert plan.create == (0, 1, 2) and plan.delete == () and plan.admitted == 0


def test_deployment_follows_admitted_only() -> None:
    plan = plan_workloads(3, obs(make_workload(0, admitted=True, flavor="h200"),
                                 make_workload(1, admitted=True, flavor="h200"),
                                 make_workload(2, pending_message="insufficient quota")), "h")
    assert plan.create == () and plan.delete == ()
    assert plan.admitted_by_flavor == {"h200": 2}
    assert [w.name for w in plan.pending] == ["llama-2"]


def test_scale_down_deletes_highest_ordinals_at_once() -> None:
    plan = plan_workloads(1, obs(make_workload(0, admitted=True, flavor="h200"),
                                 make_workload(1, admitted=True, flavor="h200"),
                                 make_workload(2, admitted=True, flavor="h200")), "h")
    assert plan.delete == ("llama-1", "llama-2")
    assert plan.admitted_by_flavor == {"h200": 1}


def test_evicted_workload_goes_down_and_is_replaced_once_gone() -> None:
    plan = plan_workloads(2, obs(make_workload(0, admitted=True, flavor="h200"),
                                 make_workload(1, admitted=True, flavor="h200", evicted=True)), "h")
    assert plan.delete == ("llama-1",) and plan.create == ()
    assert plan.admitted_by_flavor == {"h200": 1}
    # While it terminates, nothing is created under its name; once gone, it is recreated.
    plan = plan_workloads(2, obs(make_workload(0, admitted=True, flavor="h200"),
                                 make_workload(1, admitted=True, flavor="h200", evicted=True, terminating=True)),
                          "h")
    assert plan.create == () and plan.delete == ()
    plan = plan_workloads(2, obs(make_workload(0, admitted=True, flavor="h200")), "h")
    assert plan.create == (1,)


def test_restart_is_idempotent() -> None:
    """A restarted operator with the same observation plans nothing new: no duplicates."""
    state = obs(make_workload(0, admitted=True, flavor="h200"), make_workload(1, pending_message="wait"))
    plan = plan_workloads(2, state, "h")
    assert plan.create == () and plan.delete == ()


def test_stale_pending_replaced_at_once_admitted_one_at_a_time() -> None:
    plan = plan_workloads(3, obs(make_workload(0, admitted=True, flavor="a", spec_hash="old"),
                                 make_workload(1, admitted=True, flavor="a", spec_hash="old"),
                                 make_workload(2, spec_hash="old", pending_message="wait")), "new")
    assert plan.delete == ("llama-2",)  # pending stale replaced; admitted wait for the next round
    plan = plan_workloads(2, obs(make_workload(0, admitted=True, flavor="a", spec_hash="old"),
                                 make_workload(1, admitted=True, flavor="a", spec_hash="old")), "new")
    assert plan.delete == ("llama-0",)
    assert plan.admitted_by_flavor == {"a": 1}


def test_inactive_workload_is_kept_but_not_run() -> None:
    plan = plan_workloads(1, obs(make_workload(0, admitted=True, flavor="a", active=False)), "h")
    assert plan.delete == () and plan.create == () and plan.admitted == 0


def test_flavors_split_and_emptied_flavor_goes_to_zero() -> None:
    plan = plan_workloads(3, obs(make_workload(0, admitted=True, flavor="h200"),
                                 make_workload(1, admitted=True, flavor="l40s"),
                                 make_workload(2, admitted=True, flavor="l40s")), "h")
    assert plan.admitted_by_flavor == {"h200": 1, "l40s": 2}
    assert plan_deployment_replicas(plan.admitted_by_shape, [("h200", "h"), ("a100", "h")]) == {
        ("a100", "h"): 0, ("h200", "h"): 1, ("l40s", "h"): 2}


def test_a_resource_change_rolls_shape_by_shape() -> None:
    """Pods of the old shape shrink as their workloads are replaced; the new shape grows on admission."""
    state = [make_workload(0, admitted=True, flavor="a", spec_hash="old"),
             make_workload(1, admitted=True, flavor="a", spec_hash="old")]
    plan = plan_workloads(2, obs(*state), "new")
    assert plan.delete == ("llama-0",)
    assert plan_deployment_replicas(plan.admitted_by_shape, [("a", "old")]) == {("a", "old"): 1}
    state = [make_workload(0, admitted=True, flavor="a", spec_hash="new"),
             make_workload(1, admitted=True, flavor="a", spec_hash="old")]
    plan = plan_workloads(2, obs(*state), "new")
    assert plan.delete == ("llama-1",)
    assert plan_deployment_replicas(plan.admitted_by_shape, [("a", "old"), ("a", "new")]) == {
        ("a", "new"): 1, ("a", "old"): 0}


def test_frozen_plan_changes_nothing_and_keeps_admitted() -> None:
    plan = frozen_plan(2, obs(make_workload(0, admitted=True, flavor="a"), make_workload(1, pending_message="m"),
                              make_workload(5, admitted=True, flavor="a")))
    assert plan.create == () and plan.delete == () and plan.admitted_by_flavor == {"a": 1}


def test_negative_desired_is_refused() -> None:
    with pytest.raises(ValueError, match="desired"):
        plan_workloads(-1, [], "h")
