"""Reading Kueue v1beta2 Workload status."""
from __future__ import annotations

from kvfleet.operator.kueue_state import assigned_flavor, observe_workload, quantity_to_int, requested_gpus

from op_factories import make_workload


def test_admitted_workload() -> None:
    w = observe_workload(make_workload(4, admitted=True, flavor="h200", gpus=2))
    assert w.admitted and w.running_allowed and w.flavor == "h200" and w.gpus == 2 and w.ordinal == 4
    assert w.pending_message is None


def test_pending_carries_kueue_message() -> None:
    msg = "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu in flavor h200"
    w = observe_workload(make_workload(0, pending_message=msg))
    assert not w.admitted and not w.running_allowed and w.pending_message == msg


def test_evicted_and_terminating_may_not_run() -> None:
    assert not observe_workload(make_workload(0, admitted=True, flavor="a", evicted=True)).running_allowed
    assert not observe_workload(make_workload(0, admitted=True, flavor="a", terminating=True)).running_allowed


def test_admitted_condition_without_admission_is_not_admitted() -> None:
    wl = make_workload(0, admitted=True, flavor="a")
    del wl["status"]["admission"]
    assert observe_workload(wl).admitted is False
    assert assigned_flavor(wl) is None


def test_quantities_and_requests() -> None:
    assert quantity_to_int("4") == 4 and quantity_to_int(2) == 2 and quantity_to_int(None) == 0
    wl = make_workload(0, gpus=3)
    wl["spec"]["podSets"][0]["count"] = 2
    assert requested_gpus(wl) == 6
