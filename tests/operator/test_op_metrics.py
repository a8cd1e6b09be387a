"""The operator's replica gauges: they mirror a ModelDeployment's status counts and go with it."""
from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from kvfleet.operator import handlers, metrics
from kvfleet.operator.metrics import ReplicaGauges, replica_count


def sample(registry: CollectorRegistry, metric: str, namespace: str, name: str) -> float | None:
    return registry.get_sample_value(metric, {"namespace": namespace, "name": name})


def test_record_mirrors_status_counts() -> None:
    registry = CollectorRegistry()
    gauges = ReplicaGauges(registry)
    gauges.record("team-a", "chat", {"desiredReplicas": 3, "admittedReplicas": 2, "readyReplicas": 1,
                                      "pendingReplicas": 1})
    got = [sample(registry, f"kvfleet_operator_{k}_replicas", "team-a", "chat")
           for k in ("desired", "admitted", "ready")]
    assert got == [3.0, 2.0, 1.0]
    gauges.record("team-a", "chat", {"desiredReplicas": 0, "admittedReplicas": 0, "readyReplicas": 0})
    assert sample(registry, "kvfleet_operator_desired_replicas", "team-a", "chat") == 0.0  # scaled to zero: 0


def test_missing_count_stays_absent_and_forget_drops_only_that_object() -> None:
    registry = CollectorRegistry()
    gauges = ReplicaGauges(registry)
    gauges.record("team-a", "chat", {"desiredReplicas": 2, "readyReplicas": True})  # a bool is no count
    gauges.record("team-a", "code", {"desiredReplicas": 1, "admittedReplicas": 1, "readyReplicas": 1})
    text = generate_latest(registry).decode()
    assert 'kvfleet_operator_admitted_replicas{name="chat"' not in text
    assert 'kvfleet_operator_ready_replicas{name="chat"' not in text
    gauges.forget("team-a", "chat")
    gauges.forget("team-a", "chat")  # twice is fine
    text = generate_latest(registry).decode()
    assert 'name="chat"' not in text
    assert sample(registry, "kvfleet_operator_ready_replicas", "team-a", "code") == 1.0


def test_replica_count() -> None:
    assert replica_count({"a": "3", "b": 4}, "a", "b") == 4
    assert replica_count({"a": False}, "a") is None and replica_count({}, "a") is None


def test_deleted_event_drops_the_series_in_the_served_registry() -> None:
    metrics.REPLICAS.record("ns-del", "gone", {"desiredReplicas": 2, "admittedReplicas": 2, "readyReplicas": 2})
    handlers.mdep_event(type="MODIFIED", namespace="ns-del", name="gone")
    assert sample(REGISTRY, "kvfleet_operator_ready_replicas", "ns-del", "gone") == 2.0
    handlers.mdep_event(type="DELETED", namespace="ns-del", name="gone")
    for kind in ("desired", "admitted", "ready"):
        assert sample(REGISTRY, f"kvfleet_operator_{kind}_replicas", "ns-del", "gone") is None
