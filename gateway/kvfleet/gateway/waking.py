"""Models at zero: what the gateway reads of a ModelDeployment's scale, and what a held request gets (pure).

A request for an autoscaled model (`spec.autoscaling.enabled`) with no ready replica is held at the
gateway: the gateway's demand gauge (`kvfleet_gateway_model_waiting_requests`) makes the operator's
autoscaler ask for a replica, which Kueue admits within the tenant's quota or not. While held:

1. Kueue will not admit it: the ModelDeployment's `QuotaExceeded` condition is True with no replica
   admitted -> 429 `quota_exceeded`, `Retry-After`, Kueue's own message (never a bypass of quota, never a
   hang). A message saying Kueue is preempting to make room ("Pending the preemption of ...") is an
   admission on its way: the request keeps waiting.
2. No replica admitted within `admission_timeout` (the autoscaler or the operator is not acting) -> 503
   `not_admitted`, naming the `Admitted` condition's message.
3. Admitted, not ready within `wake_timeout` (the engine is still loading, or cannot) -> 504 `wake_timeout`.
4. A replica turns ready -> the request goes to it (the dispatcher's part).

A model that is not autoscaled and has no ready replica is answered 503 `no_replica` at once, as before:
nothing would bring one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

PREEMPTING = "Pending the preemption"  # Kueue's wording when it evicts others to admit this workload


@dataclass(frozen=True)
class ModelScale:
    """A ModelDeployment's spec and status as far as holding requests and saturation need them."""

    autoscaled: bool = False  # spec.autoscaling.enabled with maxReplicas >= 1: demand can wake it
    desired: int = 0
    admitted: int = 0
    ready: int = 0
    quota_message: str | None = None  # QuotaExceeded=True: Kueue's message
    admitted_message: str = ""  # the Admitted condition's message
    capacity: int | None = None  # spec.engine.maxNumSeqs: requests one replica runs at once

    @property
    def quota_refused(self) -> bool:
        """Kueue keeps the model's replicas out for quota, with none admitted, and is not preempting for them."""
        return (self.quota_message is not None and self.admitted == 0 and self.desired >= 1
                and PREEMPTING not in self.quota_message)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def model_scale(mdep: Mapping[str, Any]) -> ModelScale:
    spec = mdep.get("spec") or {}
    status = mdep.get("status") or {}
    auto = spec.get("autoscaling") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or () if isinstance(c, Mapping)}
    quota = conditions.get("QuotaExceeded") or {}
    capacity = (spec.get("engine") or {}).get("maxNumSeqs")
    return ModelScale(
        autoscaled=bool(auto.get("enabled")) and _int(auto.get("maxReplicas", 1)) >= 1,
        desired=_int(status.get("desiredReplicas")),
        admitted=_int(status.get("admittedReplicas")),
        ready=_int(status.get("readyReplicas")),
        quota_message=str(quota.get("message") or "Kueue: insufficient quota") if quota.get("status") == "True"
        else None,
        admitted_message=str((conditions.get("Admitted") or {}).get("message") or ""),
        capacity=capacity if isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1
        else None,
    )


@dataclass(frozen=True)
class HoldConfig:
    admission_timeout: float = 60.0  # held, no replica admitted yet -> 503 (longer than the autoscaler's interval)
    wake_timeout: float = 300.0  # held in all -> 504 (an engine loading its model on a GPU takes minutes)
    queue_timeout: float = 120.0  # queued while every replica is saturated -> 503
    quota_retry_after: int = 30  # Retry-After of a quota refusal (quota frees when other work ends)
    max_queued_per_tenant: int = 100  # per model: more waiting -> 429


@dataclass(frozen=True)
class Verdict:
    action: Literal["wait", "refuse"]
    status: int = 0
    code: str = ""
    message: str = ""
    retry_after: int = 0


WAIT = Verdict("wait")


def held_verdict(scale: ModelScale, waited: float, cfg: HoldConfig, model: str) -> Verdict:
    """What a request held for `waited` seconds for `model` (which has no ready replica) gets now."""
    if scale.quota_refused:
        return Verdict("refuse", 429, "quota_exceeded",
                       f"The model `{model}` is scaled to zero and Kueue does not admit a replica within the "
                       f"tenant's GPU quota: {scale.quota_message}", cfg.quota_retry_after)
    if scale.admitted == 0 and waited >= cfg.admission_timeout:
        why = f" ({scale.admitted_message})" if scale.admitted_message else ""
        return Verdict("refuse", 503, "not_admitted",
                       f"The model `{model}` is scaled to zero and no replica was admitted within "
                       f"{cfg.admission_timeout:g}s{why}.", 10)
    if waited >= cfg.wake_timeout:
        return Verdict("refuse", 504, "wake_timeout",
                       f"The model `{model}` is scaling from zero and no replica became ready within "
                       f"{cfg.wake_timeout:g}s ({scale.admitted} admitted, still starting).", 10)
    return WAIT


def next_check(scale: ModelScale, waited: float, cfg: HoldConfig) -> float:
    """Seconds until `held_verdict` may change by time alone (status changes are pushed by the dispatcher)."""
    deadlines = [cfg.wake_timeout]
    if scale.admitted == 0:
        deadlines.append(cfg.admission_timeout)
    later = [d - waited for d in deadlines if d > waited]
    return max(0.01, min(later)) if later else 0.01
