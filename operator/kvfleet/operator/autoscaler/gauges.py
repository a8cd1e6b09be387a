"""Autoscaler metrics per ModelDeployment (prometheus_client, default registry).

The replica gauges (desired / admitted / ready) are not here: the operator's reconcile writes
them for every ModelDeployment (``kvfleet.operator.metrics.REPLICAS``), autoscaled or not.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from kvfleet.operator.autoscaler.policy import Decision

_LABELS = ("namespace", "name")
ACTIONS = ("scale_up", "scale_down", "hold")


class ScalingGauges:
    """Last observed queue depth, pods with unknown metrics, decisions by action."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.queue_depth = Gauge("kvfleet_operator_queue_depth",
                                 "Last observed waiting + running requests over the ready pods.",
                                 _LABELS, registry=registry)
        self.unknown_pods = Gauge("kvfleet_operator_autoscaler_unknown_pods",
                                  "Ready pods whose metrics could not be read at the last decision.",
                                  _LABELS, registry=registry)
        self.decisions = Counter("kvfleet_operator_autoscaler_decisions",
                                 "Autoscaler decisions by action.", (*_LABELS, "action"),
                                 registry=registry)

    def record(self, namespace: str, name: str, decision: Decision) -> None:
        labels = {"namespace": namespace, "name": name}
        self.queue_depth.labels(**labels).set(decision.queue_depth)
        self.unknown_pods.labels(**labels).set(len(decision.unknown_pods))
        self.decisions.labels(**labels, action=decision.action).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop the autoscaler's series of a ModelDeployment (deleted, or autoscaling turned off)."""
        for g in (self.queue_depth, self.unknown_pods):
            try:
                g.remove(namespace, name)
            except KeyError:
                pass
        for action in ACTIONS:
            try:
                self.decisions.remove(namespace, name, action)
            except KeyError:
                pass
