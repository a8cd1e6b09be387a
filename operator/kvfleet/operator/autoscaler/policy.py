"""The autoscaling policy: a pure function from observations to a replica decision.

Rules (the contract the tests hold it to):

* demand = sum over pods whose metrics were read of (waiting + running requests), plus the
  requests waiting at the gateway for a replica (``gateway_waiting``, see ``demand``);
  needed = ceil(demand / targetQueueDepth), clamped to [minReplicas, maxReplicas].
* Scale up at once, by as many replicas as needed (never one at a time).
* Scale down only after demand has stayed below the current replica count for
  ``scaleDownDelaySeconds``; the target is then the *highest* need of the last
  ``scaleDownDelaySeconds`` (a sliding stabilisation window, like the HPA's), so a
  short dip does not shed replicas that the next burst needs again, and never fewer
  replicas than pods that still hold requests (``busy``). While the window holds the
  count up, it keeps sliding, so the count follows the need down tick by tick.
* Any demand at or above the current count restarts the window: a steady load
  that hovers around a boundary never flaps.
* Unknown is not zero: a pod whose metrics could not be read blocks scale-down
  (and restarts the window), because its queue might be full. Scale-up still
  happens when the pods that *were* read already justify it.
* The policy never asks for more than ``maxReplicas``; whether Kueue admits them
  is the operator's business, not the policy's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Optional, Sequence

Action = Literal["scale_up", "scale_down", "hold"]


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling`` of a ModelDeployment, validated."""

    min_replicas: int
    max_replicas: int
    target_queue_depth: float
    scale_down_delay_seconds: float

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"autoscaling.minReplicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(
                "autoscaling.maxReplicas must be >= minReplicas and >= 1, "
                f"got maxReplicas={self.max_replicas} minReplicas={self.min_replicas}"
            )
        if not self.target_queue_depth > 0:
            raise ValueError(
                f"autoscaling.targetQueueDepth must be > 0, got {self.target_queue_depth}"
            )
        if self.scale_down_delay_seconds < 0:
            raise ValueError(
                "autoscaling.scaleDownDelaySeconds must be >= 0, "
                f"got {self.scale_down_delay_seconds}"
            )

    @classmethod
    def from_spec(cls, autoscaling: dict[str, Any]) -> "AutoscalingSpec":
        """Build from the CRD's camelCase dict (defaults as in the CRD)."""

        def num(key: str, default: float) -> float:
            value = autoscaling.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"autoscaling.{key} must be a number, got {value!r}")
            return value

        return cls(
            min_replicas=int(num("minReplicas", 1)),
            max_replicas=int(num("maxReplicas", 1)),
            target_queue_depth=float(num("targetQueueDepth", 4)),
            scale_down_delay_seconds=float(num("scaleDownDelaySeconds", 300)),
        )


@dataclass(frozen=True)
class PodLoad:
    """What one ready pod reported; ``None`` means it could not be read."""

    pod: str
    waiting: Optional[float]
    running: Optional[float]
    error: str = ""

    @property
    def known(self) -> bool:
        return self.waiting is not None and self.running is not None

    @property
    def busy(self) -> bool:
        return self.known and (self.waiting or 0) + (self.running or 0) > 0


@dataclass(frozen=True)
class AutoscalerState:
    """The small state kept between decisions (saved in the ModelDeployment's status)."""

    low_demand_since: Optional[float] = None  # when need first dropped below current
    # Sliding-window maximum of the need over the last scaleDownDelaySeconds: (time, need) pairs with
    # needs strictly decreasing, so it holds at most maxReplicas entries whatever the interval.
    peaks: tuple[tuple[float, int], ...] = ()

    @property
    def window_peak(self) -> int:
        return self.peaks[0][1] if self.peaks else 0


def push_peak(peaks: tuple[tuple[float, int], ...], now: float, need: int,
              window: float) -> tuple[tuple[float, int], ...]:
    """Add ``need`` at ``now`` and forget what left the window ``(now - window, now]``."""
    kept = [p for p in peaks if p[1] > need] + [(now, need)]  # a lower, older need can never be the max
    while len(kept) > 1 and kept[0][0] <= now - window:
        kept.pop(0)
    return tuple(kept)


@dataclass(frozen=True)
class Decision:
    """A decision with the inputs it was made from, for status and Events."""

    action: Action
    current: int
    desired: int
    needed: int
    waiting: float
    running: float
    busy: int
    known_pods: int
    unknown_pods: tuple[str, ...]
    reason: str
    time: float
    state: AutoscalerState = field(default_factory=AutoscalerState)
    gateway_waiting: float = 0.0  # requests waiting at the gateway (held at zero, or queued while saturated)

    @property
    def queue_depth(self) -> float:
        return self.waiting + self.running + self.gateway_waiting

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["unknown_pods"] = list(self.unknown_pods)
        out["queue_depth"] = self.queue_depth
        return out


def needed_replicas(demand: float, spec: AutoscalingSpec) -> int:
    """Replicas for ``demand`` requests at ``targetQueueDepth`` each, clamped."""
    raw = math.ceil(demand / spec.target_queue_depth - 1e-9) if demand > 0 else 0
    return max(spec.min_replicas, min(spec.max_replicas, raw))


def decide(
    spec: AutoscalingSpec,
    current: int,
    pods: Sequence[PodLoad],
    state: AutoscalerState,
    now: float,
    gateway_waiting: float = 0.0,
) -> Decision:
    """Decide the desired replica count. Pure: same inputs, same decision."""
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    known = [p for p in pods if p.known]
    unknown = tuple(sorted(p.pod for p in pods if not p.known))
    waiting = float(sum(p.waiting or 0 for p in known))
    running = float(sum(p.running or 0 for p in known))
    busy = sum(1 for p in known if p.busy)
    gateway_waiting = max(0.0, float(gateway_waiting))
    needed = needed_replicas(waiting + running + gateway_waiting, spec)
    base = Decision(
        action="hold", current=current, desired=current, needed=needed, waiting=waiting,
        running=running, busy=busy, known_pods=len(known), unknown_pods=unknown,
        reason="", time=now, state=AutoscalerState(), gateway_waiting=gateway_waiting,
    )
    at_gateway = f", {gateway_waiting:g} at the gateway" if gateway_waiting else ""
    demand = (f"queue depth {waiting + running + gateway_waiting:g} ({waiting:g} waiting, {running:g} running"
              f"{at_gateway})")

    # Bounds first: a spec change moves the count into range at once (up to the need, if higher).
    if current < spec.min_replicas or current > spec.max_replicas:
        target = max(spec.min_replicas, needed) if current < spec.min_replicas else spec.max_replicas
        return replace(
            base, action="scale_up" if target > current else "scale_down", desired=target,
            reason=f"replicas {current} outside [{spec.min_replicas}, {spec.max_replicas}]; {demand}",
        )
    if needed > current:
        return replace(
            base, action="scale_up", desired=needed,
            reason=f"{demand} needs {needed} replicas at {spec.target_queue_depth:g} per replica",
        )
    if needed == current:
        return replace(base, reason=f"{demand} matches {current} replicas")
    if unknown:
        return replace(
            base,
            reason=f"metrics unknown for {len(unknown)} pod(s) ({', '.join(unknown)}); "
            "not scaling down",
        )
    # Demand is below the current count and every pod was read.
    since = state.low_demand_since if state.low_demand_since is not None else now
    peaks = push_peak(state.peaks if state.low_demand_since is not None else (), now, needed,
                      spec.scale_down_delay_seconds)
    window = AutoscalerState(since, peaks)
    waited = now - since
    if waited < spec.scale_down_delay_seconds:
        return replace(
            base, state=window,
            reason=f"{demand} needs {needed}; scale-down after "
            f"{spec.scale_down_delay_seconds:g}s of lower demand ({waited:g}s so far)",
        )
    # Like the HPA's stabilisation window: the highest need of the last scaleDownDelaySeconds.
    peak = window.window_peak
    target = max(peak, busy, spec.min_replicas)
    if target >= current:
        return replace(
            base, state=window,
            reason=f"{demand}; highest need in the last {spec.scale_down_delay_seconds:g}s is {peak}, "
            f"{busy} replicas busy: holding {current}",
        )
    # The window stays open while the peak or busy pods, not today's need, hold the count up.
    next_state = AutoscalerState() if target == max(needed, spec.min_replicas) else window
    return replace(
        base, action="scale_down", desired=target, state=next_state,
        reason=f"{demand} below {current} replicas for {waited:g}s; "
        f"scaling to {target} (window peak {peak}, busy {busy})",
    )
