"""Status and conditions from observation; Events on transitions only."""
from __future__ import annotations

from kvfleet.operator.errors import SpecError
from kvfleet.operator.kueue_state import observe_workload
from kvfleet.operator.plan import plan_workloads
from kvfleet.operator.status import Observation, compute_status, status_changed, status_event, transition_events

from op_factories import make_workload

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
MSG = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor h200"


def observe(desired: int, wls: list, ready: int = 0, pods: int | None = None, problem=None) -> Observation:
    plan = plan_workloads(desired, [observe_workload(w) for w in wls], "h")
    return Observation(generation=3, desired=desired, plan=plan,
                       pod_replicas=plan.admitted if pods is None else pods, ready_replicas=ready,
                       endpoint="http://llama.team-a.svc.cluster.local:8000/v1", selector="a=b", problem=problem)


def conds(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_all_admitted_and_ready() -> None:
    st = compute_status(observe(2, [make_workload(0, admitted=True, flavor="h200"),
                                    make_workload(1, admitted=True, flavor="h200")], ready=2), {}, T0)
    c = conds(st)
    assert c["Admitted"]["status"] == "True" and c["Available"]["status"] == "True"
    assert c["Progressing"]["status"] == "False" and c["QuotaExceeded"]["status"] == "False"
    assert (st["desiredReplicas"], st["admittedReplicas"], st["readyReplicas"], st["pendingReplicas"]) == (2, 2, 2, 0)
    assert st["observedGeneration"] == 3 and st["endpoint"].endswith(":8000/v1")
    assert st["flavors"] == [{"name": "h200", "admittedReplicas": 2}]
    assert all(x["observedGeneration"] == 3 for x in st["conditions"])


def test_pending_on_quota_carries_kueue_reason() -> None:
    st = compute_status(observe(2, [make_workload(0, admitted=True, flavor="h200"),
                                    make_workload(1, pending_message=MSG)], ready=1), {}, T0)
    c = conds(st)
    assert c["Admitted"]["status"] == "False" and c["Admitted"]["reason"] == "Pending"
    assert MSG in c["Admitted"]["message"] and "1/2" in c["Admitted"]["message"]
    assert c["QuotaExceeded"] == {**c["QuotaExceeded"], "status": "True", "reason": "InsufficientQuota",
                                  "message": MSG}
    assert c["Progressing"]["reason"] == "WaitingForAdmission"
    assert c["Available"]["status"] == "True"
    assert st["pendingReplicas"] == 1


def test_problem_becomes_condition_reason() -> None:
    err = SpecError("spec.resources.gpuFlavor", "ResourceFlavor 'x' does not exist", "FlavorNotFound")
    c = conds(compute_status(observe(1, [], problem=err), {}, T0))
    assert c["Admitted"]["reason"] == "FlavorNotFound" and "spec.resources.gpuFlavor" in c["Admitted"]["message"]
    assert c["Progressing"]["reason"] == "FlavorNotFound"


def test_transition_time_moves_only_on_flip_and_unchanged_status_is_not_patched() -> None:
    o = observe(1, [make_workload(0, admitted=True, flavor="a")], ready=1)
    first = compute_status(o, {}, T0)
    again = compute_status(o, first, T1)
    assert again == first and not status_changed(first, again)
    assert transition_events(first["conditions"], again["conditions"]) == []
    down = compute_status(observe(1, [make_workload(0, admitted=True, flavor="a")], ready=0), first, T1)
    assert status_changed(first, down)
    avail = conds(down)["Available"]
    assert avail["status"] == "False" and avail["lastTransitionTime"] == T1
    assert conds(down)["Admitted"]["lastTransitionTime"] == T0


def test_events_on_transitions() -> None:
    pending = compute_status(observe(1, [make_workload(0, pending_message=MSG)]), {}, T0)
    events = transition_events([], pending["conditions"])
    assert ("Warning", "InsufficientQuota", f"QuotaExceeded=True (InsufficientQuota): {MSG}") in events
    admitted = compute_status(observe(1, [make_workload(0, admitted=True, flavor="a")], ready=1), pending, T1)
    reasons = {(t, r) for t, r, _ in transition_events(pending["conditions"], admitted["conditions"])}
    assert ("Normal", "AllReplicasAdmitted") in reasons and ("Normal", "WithinQuota") in reasons


def test_one_event_per_status_write_the_warning_first() -> None:
    ready = compute_status(observe(1, [make_workload(0, admitted=True, flavor="a")], ready=1), {}, T0)
    fresh = status_event([], ready["conditions"])
    assert fresh is not None and fresh[:2] == ("Normal", "AllReplicasAdmitted")
    assert "Available=True (MinimumReplicasAvailable)" in fresh[2] and "Progressing=False (ReplicasReady)" in fresh[2]
    over = compute_status(observe(2, [make_workload(0, admitted=True, flavor="a"),
                                      make_workload(1, pending_message=MSG)], ready=1), ready, T1)
    kind, reason, message = status_event(ready["conditions"], over["conditions"]) or ("", "", "")
    assert (kind, reason) == ("Warning", "InsufficientQuota")  # not Admitted's Normal "Pending", listed first
    assert "Admitted=False (Pending)" in message and MSG in message
    assert status_event(over["conditions"], over["conditions"]) is None


def test_scaled_to_zero() -> None:
    c = conds(compute_status(observe(0, []), {}, T0))
    assert c["Admitted"]["reason"] == "NoReplicasRequested" and c["Available"]["reason"] == "ScaledToZero"


def test_autoscaler_status_is_not_ours() -> None:
    st = compute_status(observe(1, [make_workload(0, admitted=True, flavor="a")], ready=1), {}, T0)
    assert "autoscaler" not in st
    assert not status_changed({**st, "autoscaler": {"desiredReplicas": 3}}, st)
