"""The autoscaler's saved state and status, kept in ``status.autoscaler`` of the ModelDeployment.

Pure conversions between the policy's dataclasses and the camelCase status dict, so
that a restarted operator resumes a scale-down window where the last one left it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping, Optional

from kvfleet.operator.autoscaler.policy import AutoscalerState, Decision

STATUS_KEY = "autoscaler"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def state_from_status(status: Optional[Mapping[str, Any]]) -> AutoscalerState:
    """Read the saved state; anything missing or malformed starts a fresh window."""
    saved = ((status or {}).get(STATUS_KEY) or {}).get("state") or {}
    since: Any = saved.get("lowDemandSince")
    if not _number(since):
        return AutoscalerState()
    peaks = []
    for item in saved.get("windowPeaks") or []:
        if (isinstance(item, list) and len(item) == 2 and _number(item[0]) and isinstance(item[1], int)
                and not isinstance(item[1], bool) and item[1] >= 0):
            peaks.append((float(item[0]), item[1]))
    return AutoscalerState(low_demand_since=float(since), peaks=tuple(peaks))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def status_patch(decision: Decision, metric_source: str,
                 errors: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """``status.autoscaler`` for a decision: its inputs (with why each unknown pod could not be read),
    the outcome and the saved state."""
    reasons = [f"{pod}: {(errors or {}).get(pod, 'unknown')}"[:240] for pod in decision.unknown_pods]
    state: dict[str, Any] = {"lowDemandSince": decision.state.low_demand_since,
                             "windowPeaks": [[t, n] for t, n in decision.state.peaks]}
    return {
        STATUS_KEY: {
            "desiredReplicas": decision.desired,
            "lastDecision": {
                "action": decision.action,
                "from": decision.current,
                "to": decision.desired,
                "reason": decision.reason,
                "time": iso(decision.time),
            },
            "inputs": {
                "metricSource": metric_source,
                "queueDepth": decision.queue_depth,
                "waiting": decision.waiting,
                "gatewayWaiting": decision.gateway_waiting,
                "running": decision.running,
                "neededReplicas": decision.needed,
                "busyReplicas": decision.busy,
                "podsRead": decision.known_pods,
                "podsUnknown": list(decision.unknown_pods),
                # A list, not a map: a merge patch replaces lists whole, so old pods never linger.
                "podsUnknownReasons": reasons,
            },
            "state": state,
        }
    }


def _essence(value: Any) -> Any:
    """A status value without None entries (a merge patch deletes them) and without the decision time."""
    if isinstance(value, Mapping):
        return {k: _essence(v) for k, v in value.items() if v is not None and k != "time"}
    if isinstance(value, list):
        return [_essence(v) for v in value]
    return value


def status_unchanged(old: Optional[Mapping[str, Any]], new: Mapping[str, Any]) -> bool:
    """True when writing ``new`` over ``old`` (both ``status.autoscaler``) would change nothing but the time,
    so a steady ModelDeployment's status is not rewritten on every tick."""
    return old is not None and _essence(old) == _essence(new)


def event_message(decision: Decision) -> str:
    """One line for a Kubernetes Event."""
    unknown = f", unknown pods: {', '.join(decision.unknown_pods)}" if decision.unknown_pods else ""
    return (
        f"{decision.action} {decision.current}->{decision.desired}: {decision.reason}"
        f" (pods read: {decision.known_pods}{unknown})"
    )
