"""desired_replicas: spec, or the autoscaler's decision within its bounds."""
from __future__ import annotations

from kvfleet.operator.scaling import desired_replicas

from op_factories import make_mdep


def test_manual_replicas() -> None:
    assert desired_replicas(make_mdep({"model": {"source": "a/b"}, "replicas": 3})) == 3
    # The autoscaler's state is ignored unless autoscaling is on.
    assert desired_replicas(make_mdep({"model": {"source": "a/b"}, "replicas": 3}), {"desiredReplicas": 7}) == 3


def test_autoscaler_decision_clamped() -> None:
    spec = {"model": {"source": "a/b"}, "replicas": 1,
            "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}}
    assert desired_replicas(make_mdep(spec), {"desiredReplicas": 3}) == 3
    assert desired_replicas(make_mdep(spec), {"desiredReplicas": 9}) == 4
    assert desired_replicas(make_mdep(spec, status={"autoscaler": {"desiredReplicas": 2}})) == 2
    assert desired_replicas(make_mdep({**spec, "replicas": 0})) == 1  # no decision yet: spec within bounds
    assert desired_replicas(make_mdep(spec), {"desiredReplicas": "x"}) == 1
