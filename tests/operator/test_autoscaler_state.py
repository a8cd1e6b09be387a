"""Saved state and status of the autoscaler, and the choice of pods to read."""

from __future__ import annotations

from typing import Any

from kvfleet.operator.autoscaler.metrics import PodTarget
from kvfleet.operator.autoscaler.pods import ready_targets
from kvfleet.operator.autoscaler.policy import (
    AutoscalerState,
    AutoscalingSpec,
    PodLoad,
    decide,
)
from kvfleet.operator.autoscaler.state import event_message, state_from_status, status_patch, status_unchanged

SPEC = AutoscalingSpec(1, 4, 4, 60)


def test_state_round_trips_through_status() -> None:
    d = decide(SPEC, 3, [PodLoad("a", 1, 1), PodLoad("b", 0, 0)], AutoscalerState(), 1_700_000_000)
    patch = status_patch(d, "scrape")
    assert state_from_status(patch) == d.state == AutoscalerState(1_700_000_000, ((1_700_000_000, 1),))
    auto = patch["autoscaler"]
    assert auto["desiredReplicas"] == 3
    assert auto["lastDecision"] == {"action": "hold", "from": 3, "to": 3, "reason": d.reason,
                                    "time": "2023-11-14T22:13:20Z"}
    assert auto["inputs"]["queueDepth"] == 2 and auto["inputs"]["podsRead"] == 2
    assert auto["inputs"]["metricSource"] == "scrape"


def test_restart_resumes_the_window() -> None:
    quiet = [PodLoad("a", 0, 0), PodLoad("b", 0, 0)]
    first = decide(SPEC, 2, quiet, AutoscalerState(), 100)
    resumed = state_from_status(status_patch(first, "scrape"))
    assert decide(SPEC, 2, quiet, resumed, 160).desired == 1


def test_missing_or_malformed_state_is_fresh() -> None:
    assert state_from_status(None) == AutoscalerState()
    assert state_from_status({"autoscaler": {"state": {"lowDemandSince": "yesterday"}}}) == AutoscalerState()
    bad_peaks = {"lowDemandSince": 5, "windowPeaks": [[1, -2], "x", [2, True], [3.5, 2]]}
    assert state_from_status({"autoscaler": {"state": bad_peaks}}) == AutoscalerState(5.0, ((3.5, 2),))


def test_unknown_pods_show_in_status_and_event() -> None:
    d = decide(SPEC, 2, [PodLoad("a", 0, 0), PodLoad("b", None, None, "timeout")], AutoscalerState(), 0)
    inputs = status_patch(d, "scrape", {"b": "ConnectError: refused"})["autoscaler"]["inputs"]
    assert inputs["podsUnknown"] == ["b"]
    assert inputs["podsUnknownReasons"] == ["b: ConnectError: refused"]
    assert status_patch(decide(SPEC, 2, [PodLoad("a", 0, 0)], AutoscalerState(), 0), "scrape")[
        "autoscaler"]["inputs"]["podsUnknownReasons"] == []
    assert "unknown pods: b" in event_message(d)


def pod(name: str, ip: str | None = "127.1.0.5", phase: str = "Running", ready: str = "True",
        deleting: bool = False, port: int | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    containers = [{"name": "engine", "ports": [{"name": "http", "containerPort": port}] if port else []}]
    return {"metadata": meta, "spec": {"containers": containers},
            "status": {"phase": phase, "podIP": ip,
                       "conditions": [{"type": "Ready", "status": ready}]}}


def test_only_ready_pods_are_targets() -> None:
    pods = [pod("b", port=9000), pod("a"), pod("pending", phase="Pending"), pod("noip", ip=None),
            pod("unready", ready="False"), pod("gone", deleting=True)]
    assert ready_targets(pods, default_port=8000) == [
        PodTarget("a", "127.1.0.5", 8000), PodTarget("b", "127.1.0.5", 9000)]


def test_gauges_record_and_forget() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvfleet.operator.autoscaler.gauges import ScalingGauges

    registry = CollectorRegistry()
    gauges = ScalingGauges(registry)
    d = decide(SPEC, 1, [PodLoad("a", 9, 4)], AutoscalerState(), 0)
    gauges.record("team-a", "chat", d)
    text = generate_latest(registry).decode()
    assert 'kvfleet_operator_queue_depth{name="chat",namespace="team-a"} 13.0' in text
    assert 'kvfleet_operator_autoscaler_decisions_total{action="scale_up",name="chat",namespace="team-a"} 1.0' \
        in text
    assert "_replicas{" not in text  # replica gauges belong to the operator's reconcile (kvfleet.operator.metrics)
    gauges.forget("team-a", "chat")
    assert 'namespace="team-a"' not in generate_latest(registry).decode()


def test_settings_from_env() -> None:
    import pytest

    from kvfleet.operator.autoscaler.handlers import AutoscalerSettings

    assert AutoscalerSettings.from_env({}) == AutoscalerSettings(15.0, "scrape", "")
    assert AutoscalerSettings.from_env({"KVFLEET_AUTOSCALE_INTERVAL": "2"}).interval == 2.0
    chart = {"KVFLEET_AUTOSCALER_INTERVAL_SECONDS": "5", "KVFLEET_AUTOSCALER_METRICS_SOURCE": "prometheus",
             "KVFLEET_AUTOSCALER_PROMETHEUS_URL": "http://127.0.0.1:9090"}
    assert AutoscalerSettings.from_env(chart) == AutoscalerSettings(5.0, "prometheus", "http://127.0.0.1:9090")
    for env, field in [({"KVFLEET_AUTOSCALE_INTERVAL": "0"}, "INTERVAL"),
                       ({"KVFLEET_AUTOSCALE_INTERVAL": "soon"}, "INTERVAL"),
                       ({"KVFLEET_AUTOSCALER_METRICS_SOURCE": "statsd"}, "METRICS_SOURCE"),
                       ({"KVFLEET_AUTOSCALER_METRICS_SOURCE": "prometheus"}, "PROMETHEUS_URL")]:
        with pytest.raises(ValueError, match=field):
            AutoscalerSettings.from_env(env)


def test_steady_status_is_not_rewritten() -> None:
    quiet = [PodLoad("a", 0, 0)]
    first = status_patch(decide(SPEC, 1, quiet, AutoscalerState(), 100), "scrape")["autoscaler"]
    # What the API server returns after a merge patch: None values are gone.
    stored = {**first, "state": {"windowPeaks": []}}
    later = status_patch(decide(SPEC, 1, quiet, AutoscalerState(), 160), "scrape")["autoscaler"]
    assert later["lastDecision"]["time"] != first["lastDecision"]["time"]
    assert status_unchanged(stored, later)
    busier = status_patch(decide(SPEC, 1, [PodLoad("a", 1, 1)], AutoscalerState(), 160), "scrape")["autoscaler"]
    assert not status_unchanged(stored, busier)
    assert not status_unchanged(None, later)
