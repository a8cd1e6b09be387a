"""ModelDeployment status from observation: conditions, counts, endpoint; and the Events a
status change deserves. Pure: the caller patches only when `status_changed` says so."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .errors import SpecError
from .gateway_access import CONDITION as GATEWAY_KEY_CONDITION
from .gateway_access import KeyAccess
from .plan import WorkloadPlan

CONDITION_TYPES = ("Admitted", "Available", "Progressing", "QuotaExceeded", GATEWAY_KEY_CONDITION)
# Keys of status the operator owns (status.autoscaler belongs to the autoscaler).
OWNED_KEYS = ("conditions", "replicas", "desiredReplicas", "admittedReplicas", "pendingReplicas",
              "readyReplicas", "endpoint", "observedGeneration", "selector", "flavors")


@dataclass(frozen=True)
class Observation:
    generation: int
    desired: int
    plan: WorkloadPlan | None
    pod_replicas: int
    ready_replicas: int
    endpoint: str
    selector: str
    problem: SpecError | None = None
    gateway_key: KeyAccess | None = None  # engines with their own key, and a gateway to reach them


def set_condition(old: Sequence[Mapping[str, Any]], cond_type: str, status: bool | None, reason: str,
                  message: str, generation: int, now: str) -> dict[str, Any]:
    """A condition (status None: Unknown); lastTransitionTime moves only when the status flips."""
    text = "Unknown" if status is None else "True" if status else "False"
    prev = next((c for c in old if c.get("type") == cond_type), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == text else now
    return {"type": cond_type, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": since or now, "observedGeneration": generation}


def _kueue_message(plan: WorkloadPlan) -> str | None:
    for w in plan.pending:
        if w.pending_message:
            return w.pending_message
    return None


def compute_conditions(obs: Observation, old: Sequence[Mapping[str, Any]], now: str) -> list[dict[str, Any]]:
    g, desired = obs.generation, obs.desired
    plan = obs.plan or WorkloadPlan()
    admitted, ready = plan.admitted, obs.ready_replicas
    kueue_msg = _kueue_message(plan)
    conds = []
    if obs.problem is not None:
        conds.append(set_condition(old, "Admitted", False, obs.problem.reason, obs.problem.message, g, now))
    elif desired == 0:
        conds.append(set_condition(old, "Admitted", True, "NoReplicasRequested", "desired replicas is 0", g, now))
    elif admitted >= desired:
        conds.append(set_condition(old, "Admitted", True, "AllReplicasAdmitted",
                                   f"{admitted}/{desired} workloads admitted by Kueue", g, now))
    else:
        tail = f": {kueue_msg}" if kueue_msg else ""
        conds.append(set_condition(old, "Admitted", False, "Pending",
                                   f"{admitted}/{desired} workloads admitted by Kueue{tail}", g, now))
    if ready > 0:
        conds.append(set_condition(old, "Available", True, "MinimumReplicasAvailable",
                                   f"{ready} replica(s) ready", g, now))
    else:
        reason = "ScaledToZero" if desired == 0 else "NoReplicasReady"
        conds.append(set_condition(old, "Available", False, reason, "no replica is ready", g, now))
    if obs.problem is not None:
        conds.append(set_condition(old, "Progressing", False, obs.problem.reason, obs.problem.message, g, now))
    elif admitted < desired:
        conds.append(set_condition(old, "Progressing", True, "WaitingForAdmission",
                                   f"{desired - admitted} replica(s) waiting for Kueue admission", g, now))
    elif ready < desired or obs.pod_replicas != desired:
        conds.append(set_condition(old, "Progressing", True, "WaitingForPods",
                                   f"{ready}/{desired} replicas ready", g, now))
    else:
        conds.append(set_condition(old, "Progressing", False, "ReplicasReady",
                                   f"{ready}/{desired} replicas ready", g, now))
    if kueue_msg:
        conds.append(set_condition(old, "QuotaExceeded", True, "InsufficientQuota", kueue_msg, g, now))
    else:
        conds.append(set_condition(old, "QuotaExceeded", False, "WithinQuota",
                                   "every replica fits the tenant's quota", g, now))
    if obs.gateway_key is not None:
        key = obs.gateway_key
        conds.append(set_condition(old, GATEWAY_KEY_CONDITION, key.status, key.reason, key.message, g, now))
    return conds


def compute_status(obs: Observation, old_status: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The operator-owned part of status."""
    plan = obs.plan or WorkloadPlan()
    return {
        "conditions": compute_conditions(obs, old_status.get("conditions") or (), now),
        "replicas": obs.pod_replicas,
        "desiredReplicas": obs.desired,
        "admittedReplicas": plan.admitted,
        "pendingReplicas": max(0, obs.desired - plan.admitted),
        "readyReplicas": obs.ready_replicas,
        "endpoint": obs.endpoint,
        "observedGeneration": obs.generation,
        "selector": obs.selector,
        "flavors": [{"name": f, "admittedReplicas": n} for f, n in sorted(plan.admitted_by_flavor.items())],
    }


def status_changed(old_status: Mapping[str, Any], new_status: Mapping[str, Any]) -> bool:
    return any(old_status.get(k) != new_status.get(k) for k in OWNED_KEYS)


_WARNING_REASONS = {"InsufficientQuota", "FlavorNotFound", "QueueNotFound", "PriorityClassNotFound",
                    "InvalidSpec", "NotATenantNamespace", "HostPathNotAllowed", "KeyNotGranted",
                    "AccessCheckFailed"}


def transition_events(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """(type, reason, message) for each condition whose status or reason changed."""
    before = {c.get("type"): (c.get("status"), c.get("reason")) for c in old}
    events = []
    for c in new:
        if before.get(c["type"]) == (c["status"], c["reason"]):
            continue
        if c["type"] == "QuotaExceeded" and c["status"] == "False" and c["type"] not in before:
            continue  # nothing worth telling on a fresh object
        kind = "Warning" if c["reason"] in _WARNING_REASONS else "Normal"
        events.append((kind, c["reason"], f"{c['type']}={c['status']} ({c['reason']}): {c['message']}"))
    return events


def status_event(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> tuple[str, str, str] | None:
    """One Event for a status write that moves conditions (None when none moved): the reason of its most telling
    transition (a Warning's first, else the first in condition order), every transition in the message. One
    Event per write, not per condition: a fresh ModelDeployment told its story in 3 Events instead of 7."""
    moved = transition_events(old, new)
    if not moved:
        return None
    kind, reason, _ = next((e for e in moved if e[0] == "Warning"), moved[0])
    return kind, reason, "; ".join(message for _, _, message in moved)
