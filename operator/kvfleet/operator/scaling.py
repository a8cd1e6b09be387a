"""Where the desired replica count comes from: the spec, or the autoscaler's last decision.

The autoscaler (`kvfleet.operator.autoscaler`) writes its decision into
`status.autoscaler.desiredReplicas`; this is the one function that reads it.
"""
from __future__ import annotations

from typing import Any, Mapping

from .spec import ModelDeploymentSpec, parse_model_deployment


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def desired_replicas_for(spec: ModelDeploymentSpec, autoscaler_state: Mapping[str, Any] | None) -> int:
    if not spec.autoscaling.enabled:
        return spec.replicas
    auto = spec.autoscaling
    decided = (autoscaler_state or {}).get("desiredReplicas")
    if isinstance(decided, int) and not isinstance(decided, bool):
        return clamp(decided, auto.min_replicas, auto.max_replicas)
    # No decision yet: start from the spec's replicas, kept within the autoscaling bounds.
    return clamp(spec.replicas, auto.min_replicas, auto.max_replicas)


def desired_replicas(mdep: Mapping[str, Any], autoscaler_state: Mapping[str, Any] | None = None) -> int:
    """Desired replicas of a ModelDeployment; `autoscaler_state` defaults to `status.autoscaler`."""
    if autoscaler_state is None:
        autoscaler_state = (mdep.get("status") or {}).get("autoscaler")
    return desired_replicas_for(parse_model_deployment(mdep.get("spec") or {}), autoscaler_state)
