"""The gateway's demand for a ModelDeployment: requests waiting at the gateway for a replica (pure).

The gateway writes the annotation `gateway.kvfleet.dev/demand` = `{"waiting": N, "at": <unix seconds>}`
on a ModelDeployment while requests wait for it (held while the model is at zero, or queued while every
replica is saturated), refreshed while they wait and set to 0 when none is left. The autoscaler adds
`waiting` to the engines' queue depth while the value is fresh (`max_age`), so a model at zero needs one
replica as soon as one request waits for it; a stale value (a gateway that died) counts as no demand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from kvfleet.operator.constants import GATEWAY_DEMAND_ANNOTATION

DEFAULT_MAX_AGE_S = 30.0  # three of the gateway's 10 s refreshes


@dataclass(frozen=True)
class GatewayDemand:
    waiting: int
    at: float


def demand_value(waiting: int, at: float) -> str:
    """The annotation's value (the gateway writes it)."""
    return json.dumps({"waiting": max(0, int(waiting)), "at": round(at, 3)}, separators=(",", ":"))


def parse_demand(annotations: Mapping[str, Any] | None) -> GatewayDemand | None:
    """The annotation's value, or None when absent or malformed."""
    raw = (annotations or {}).get(GATEWAY_DEMAND_ANNOTATION)
    if not isinstance(raw, str):
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    waiting, at = data.get("waiting"), data.get("at")
    if isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0:
        return None
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        return None
    return GatewayDemand(waiting, float(at))


def gateway_waiting(annotations: Mapping[str, Any] | None, now: float, max_age: float = DEFAULT_MAX_AGE_S) -> int:
    """Requests waiting at the gateway, counted while the annotation is fresh (written within `max_age`)."""
    demand = parse_demand(annotations)
    if demand is None or now - demand.at > max_age:
        return 0
    return demand.waiting
