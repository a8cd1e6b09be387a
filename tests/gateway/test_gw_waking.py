"""Holding requests for a model at zero (pure): reading the ModelDeployment, the verdicts, the demand signal."""

from __future__ import annotations

from typing import Any

from kvfleet.gateway.demand import Written, due
from kvfleet.gateway.waking import WAIT, HoldConfig, ModelScale, held_verdict, model_scale, next_check
from kvfleet.operator.autoscaler.demand import demand_value, gateway_waiting, parse_demand
from kvfleet.operator.constants import GATEWAY_DEMAND_ANNOTATION

KUEUE = ("couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor h200, "
         "request > maximum capacity (1 > 0)")


def mdep(status: dict[str, Any], autoscaling: dict[str, Any] | None = None, seqs: int | None = 4) -> dict[str, Any]:
    return {"spec": {"autoscaling": autoscaling if autoscaling is not None else
                     {"enabled": True, "minReplicas": 0, "maxReplicas": 2},
                     "engine": {"maxNumSeqs": seqs} if seqs else {}},
            "status": status}


def quota(message: str = KUEUE) -> list[dict[str, Any]]:
    return [{"type": "QuotaExceeded", "status": "True", "message": message},
            {"type": "Admitted", "status": "False", "message": f"0/1 workloads admitted by Kueue: {message}"}]


def test_model_scale_reads_spec_and_status() -> None:
    scale = model_scale(mdep({"desiredReplicas": 1, "admittedReplicas": 0, "readyReplicas": 0,
                              "conditions": quota()}))
    assert scale.autoscaled and scale.capacity == 4 and scale.quota_message == KUEUE and scale.quota_refused
    assert not model_scale(mdep({}, autoscaling={"enabled": False})).autoscaled
    assert model_scale(mdep({}, seqs=None)).capacity is None


def test_quota_refusal_is_429_with_kueues_reason() -> None:
    scale = model_scale(mdep({"desiredReplicas": 1, "conditions": quota()}))
    verdict = held_verdict(scale, 0.5, HoldConfig(quota_retry_after=30), "chat")
    assert (verdict.action, verdict.status, verdict.code, verdict.retry_after) == ("refuse", 429, "quota_exceeded", 30)
    assert KUEUE in verdict.message


def test_preemption_on_its_way_and_no_decision_yet_keep_waiting() -> None:
    preempting = model_scale(mdep({"desiredReplicas": 1, "conditions": quota("Pending the preemption of 1 workload")}))
    assert held_verdict(preempting, 1.0, HoldConfig(), "chat") == WAIT
    before_decision = model_scale(mdep({"desiredReplicas": 0, "conditions": quota()}))  # stale condition at zero
    assert held_verdict(before_decision, 1.0, HoldConfig(), "chat") == WAIT


def test_timeouts_never_hang() -> None:
    cfg = HoldConfig(admission_timeout=60, wake_timeout=300)
    nothing = ModelScale(autoscaled=True)
    assert held_verdict(nothing, 59, cfg, "chat") == WAIT
    late = held_verdict(nothing, 60, cfg, "chat")
    assert (late.status, late.code) == (503, "not_admitted")
    admitted = ModelScale(autoscaled=True, desired=1, admitted=1)
    assert held_verdict(admitted, 299, cfg, "chat") == WAIT
    assert held_verdict(admitted, 300, cfg, "chat").code == "wake_timeout"
    assert next_check(nothing, 10, cfg) == 50
    assert next_check(admitted, 10, cfg) == 290


def test_demand_annotation_round_trip_and_freshness() -> None:
    value = demand_value(3, 1000.0)
    annotations = {GATEWAY_DEMAND_ANNOTATION: value}
    assert parse_demand(annotations).waiting == 3
    assert gateway_waiting(annotations, 1010.0) == 3
    assert gateway_waiting(annotations, 1031.0) == 0  # stale: a gateway that died wakes nothing
    assert gateway_waiting({GATEWAY_DEMAND_ANNOTATION: "{bad"}, 1000.0) == 0
    assert gateway_waiting({GATEWAY_DEMAND_ANNOTATION: '{"waiting": -1, "at": 1}'}, 1.0) == 0
    assert gateway_waiting(None, 1.0) == 0


def test_the_gateway_writes_on_change_refreshes_and_clears_once() -> None:
    assert not due(None, 0, 100.0)  # nothing waits, nothing was written: leave the object alone
    assert due(None, 2, 100.0)
    assert not due(Written(2, 100.0), 2, 105.0)
    assert due(Written(2, 100.0), 2, 110.0)  # refresh
    assert due(Written(2, 100.0), 0, 101.0)  # cleared once
    assert due(Written(2, 100.0), 3, 100.5)
