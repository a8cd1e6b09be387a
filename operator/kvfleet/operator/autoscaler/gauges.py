"""Operator metrics about scaling, per ModelDeployment (prometheus_client, default registry)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, REGISTRY

from kvfleet.operator.autoscaler.policy import Decision

_LABELS = ("namespace", "name")


class ScalingGauges:
    """Desired / admitted / ready replicas, last observed queue depth, unknown pods, decisions."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=registry)

        self.desired = gauge("kvfleet_operator_desired_replicas", "Replicas the operator wants.")
        self.admitted = gauge("kvfleet_operator_admitted_replicas",
                              "Replicas whose Kueue workload is admitted.")
        self.ready = gauge("kvfleet_operator_ready_replicas", "Replicas whose pod is ready.")
        self.queue_depth = gauge("kvfleet_operator_queue_depth",
                                 "Last observed waiting + running requests over the ready pods.")
        self.unknown_pods = gauge("kvfleet_operator_autoscaler_unknown_pods",
                                  "Ready pods whose metrics could not be read at the last decision.")
        self.decisions = Counter("kvfleet_operator_autoscaler_decisions",
                                 "Autoscaler decisions by action.", (*_LABELS, "action"),
                                 registry=registry)

    def record(self, namespace: str, name: str, decision: Decision,
               admitted: Optional[int], ready: Optional[int]) -> None:
        labels = {"namespace": namespace, "name": name}
        self.desired.labels(**labels).set(decision.desired)
        self.queue_depth.labels(**labels).set(decision.queue_depth)
        self.unknown_pods.labels(**labels).set(len(decision.unknown_pods))
        self.decisions.labels(**labels, action=decision.action).inc()
        if admitted is not None:
            self.admitted.labels(**labels).set(admitted)
        if ready is not None:
            self.ready.labels(**labels).set(ready)

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted ModelDeployment."""
        for g in (self.desired, self.admitted, self.ready, self.queue_depth, self.unknown_pods):
            try:
                g.remove(namespace, name)
            except KeyError:
                pass
        for action in ("scale_up", "scale_down", "hold"):
            try:
                self.decisions.remove(namespace, name, action)
            except KeyError:
                pass


def replica_count(status: Mapping[str, Any], *keys: str) -> Optional[int]:
    """The first integer found at one of ``keys`` of a status dict (None if none)."""
    for key in keys:
        value = status.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
