"""The autoscaler loop: a kopf timer per autoscaled ModelDeployment.

Each tick: read the ready pods from the API server, read their load (scrape or
Prometheus) and the gateway's demand (the ModelDeployment's ``gateway.kvfleet.dev/demand``
annotation, ``demand``), decide (pure policy), write ``status.autoscaler`` (inputs, decision,
saved state), then, if the count changed, ask the operator to reconcile at once; the
operator turns ``status.autoscaler.desiredReplicas`` into Kueue workloads exactly as
for a manual scale (``kvfleet.operator.scaling``), so every replica goes through
Kueue admission and the tenant's quota holds. A change of the gateway's demand annotation runs a tick at
once (not at the next timer), so a model at zero starts waking as soon as a request waits for it.

Settings (environment, set by the Helm chart):
``KVFLEET_AUTOSCALER_INTERVAL_SECONDS`` (or ``KVFLEET_AUTOSCALE_INTERVAL``; default 15),
``KVFLEET_AUTOSCALER_METRICS_SOURCE`` (``scrape`` | ``prometheus``),
``KVFLEET_AUTOSCALER_PROMETHEUS_URL``, ``KVFLEET_LOOPBACK_ONLY``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import httpx
import kopf

from kvfleet.operator.autoscaler.demand import gateway_waiting
from kvfleet.operator.autoscaler.gauges import ScalingGauges
from kvfleet.operator.autoscaler.metrics import query_prometheus, scrape_pods
from kvfleet.operator.autoscaler.pods import ready_targets
from kvfleet.operator.autoscaler.policy import AutoscalingSpec, Decision, decide
from kvfleet.operator.autoscaler.state import (
    STATUS_KEY,
    event_message,
    state_from_status,
    status_patch,
    status_unchanged,
)
from kvfleet.operator.builders.meta import selector_labels
from kvfleet.operator.constants import (
    API_VERSION,
    ENGINE_PORT,
    GATEWAY_DEMAND_ANNOTATION,
    GROUP,
    MDEP_PLURAL,
    VERSION,
)
from kvfleet.operator.errors import SpecError
from kvfleet.operator.events import build_event
from kvfleet.operator.kube import KubeError
from kvfleet.operator.scaling import desired_replicas_for
from kvfleet.operator.spec import parse_model_deployment

log = logging.getLogger("kvfleet.operator.autoscaler")

GAUGES = ScalingGauges()


@dataclass(frozen=True)
class AutoscalerSettings:
    interval: float = 15.0
    source: str = "scrape"
    prometheus_url: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AutoscalerSettings":
        env = os.environ if env is None else env
        raw = env.get("KVFLEET_AUTOSCALER_INTERVAL_SECONDS") or env.get("KVFLEET_AUTOSCALE_INTERVAL") or "15"
        try:
            interval = float(raw)
        except ValueError:
            raise ValueError(f"KVFLEET_AUTOSCALER_INTERVAL_SECONDS must be a number, got {raw!r}") from None
        if interval <= 0:
            raise ValueError(f"KVFLEET_AUTOSCALER_INTERVAL_SECONDS must be > 0, got {raw!r}")
        source = env.get("KVFLEET_AUTOSCALER_METRICS_SOURCE") or "scrape"
        if source not in ("scrape", "prometheus"):
            raise ValueError(f"KVFLEET_AUTOSCALER_METRICS_SOURCE must be scrape or prometheus, got {source!r}")
        url = env.get("KVFLEET_AUTOSCALER_PROMETHEUS_URL") or ""
        if source == "prometheus" and not url:
            raise ValueError("KVFLEET_AUTOSCALER_PROMETHEUS_URL is required with metrics source prometheus")
        return cls(interval, source, url)


SETTINGS = AutoscalerSettings.from_env()


def _enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


async def autoscale_once(kube: Any, namespace: str, name: str, settings: AutoscalerSettings,
                         now: Optional[float] = None) -> Optional[Decision]:
    """One decision for one ModelDeployment; returns it (None when there is nothing to scale)."""
    mdep = await asyncio.to_thread(kube.get, API_VERSION, MDEP_PLURAL, name, namespace)
    if mdep is None or mdep["metadata"].get("deletionTimestamp"):
        return None
    try:
        spec = parse_model_deployment(mdep.get("spec") or {})
    except SpecError as exc:  # the operator reports bad specs in its conditions
        log.info("skipping invalid spec", extra={"mdep": f"{namespace}/{name}", "error": str(exc)})
        return None
    if not spec.autoscaling.enabled:
        return None
    auto = spec.autoscaling
    policy_spec = AutoscalingSpec(auto.min_replicas, auto.max_replicas, auto.target_queue_depth,
                                  auto.scale_down_delay_seconds)
    status = mdep.get("status") or {}
    old_auto = status.get("autoscaler") or {}
    current = desired_replicas_for(spec, old_auto)
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    pods = await asyncio.to_thread(kube.list, "v1", "pods", namespace, selector)
    targets = ready_targets(pods, ENGINE_PORT)
    if settings.source == "prometheus":
        loads = await query_prometheus(settings.prometheus_url, namespace, [t.name for t in targets],
                                       spec.engine_kind)
    else:
        loads = await scrape_pods(targets, spec.engine_kind)
    now = now or time.time()
    from_gateway = gateway_waiting(mdep["metadata"].get("annotations"), now)
    decision = decide(policy_spec, current, loads, state_from_status(status), now, from_gateway)
    patch = status_patch(decision, settings.source, {p.pod: p.error for p in loads if not p.known})
    if not status_unchanged(status.get("autoscaler"), patch[STATUS_KEY]):
        # Guarded by the resourceVersion we decided on: if the object changed meanwhile (autoscaling
        # turned off, a new spec), the apiserver answers 409 and the next tick decides afresh, so a
        # stale decision never lands on top of a newer change.
        guarded = {"metadata": {"resourceVersion": mdep["metadata"].get("resourceVersion")}, "status": patch}
        try:
            await asyncio.to_thread(kube.merge_patch, mdep, guarded, "status")
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.debug("object changed while deciding; skipped", extra={"mdep": f"{namespace}/{name}"})
            return None
    await _post_events(kube, mdep, decision, old_auto)
    GAUGES.record(namespace, name, decision)  # the replica gauges are the operator's reconcile's
    log.log(logging.INFO if decision.action != "hold" else logging.DEBUG, "decision",
            extra={"mdep": f"{namespace}/{name}", "action": decision.action, "from": decision.current,
                   "to": decision.desired, "queue_depth": decision.queue_depth, "reason": decision.reason})
    return decision


async def _post_events(kube: Any, mdep: Mapping[str, Any], decision: Decision,
                       old_auto: Mapping[str, Any]) -> None:
    events = []
    if decision.action != "hold":
        reason = "ScaledUp" if decision.action == "scale_up" else "ScaledDown"
        events.append(("Normal", reason, event_message(decision)))
    previously_unknown = list((old_auto.get("inputs") or {}).get("podsUnknown") or [])
    if decision.unknown_pods and list(decision.unknown_pods) != previously_unknown:
        events.append(("Warning", "MetricsUnknown", event_message(decision)))
    for event_type, reason, message in events:
        try:
            await asyncio.to_thread(kube.create, build_event(mdep, event_type, reason, message, _now_iso()))
        except Exception as exc:  # an Event is worth a log line, not a failed decision
            log.warning("event not posted", extra={"reason": reason, "error": str(exc)})


async def _tick(namespace: str | None, name: str) -> None:
    # Imported here: the operator's handlers module imports this package optionally (main.py).
    from kvfleet.operator import handlers as operator_handlers

    namespace = operator_handlers.namespaced(namespace)
    try:
        decision = await autoscale_once(operator_handlers.kube(), namespace, name, SETTINGS)
    except (KubeError, httpx.TransportError) as exc:
        # The apiserver restarting or busy: decide again at the next tick, one log line (an unhandled exception
        # would log a traceback and back the timer off for a minute).
        raise kopf.TemporaryError(f"autoscaler {namespace}/{name}: {exc!r}", delay=SETTINGS.interval) from exc
    if decision is not None and decision.desired != decision.current:
        await asyncio.to_thread(operator_handlers.reconcile_now, namespace, name)


@kopf.timer(GROUP, VERSION, MDEP_PLURAL, interval=SETTINGS.interval, when=_enabled, id="autoscaler")
async def autoscale(namespace: str | None, name: str, **_: Any) -> None:
    await _tick(namespace, name)


@kopf.on.field(GROUP, VERSION, MDEP_PLURAL, field=("metadata", "annotations", GATEWAY_DEMAND_ANNOTATION),
               when=_enabled, id="autoscaler-gateway-demand")
async def gateway_demand(namespace: str | None, name: str, new: Any, **_: Any) -> None:
    """Requests started waiting at the gateway: decide now (a model at zero wakes without waiting for the timer)."""
    waiting = gateway_waiting({GATEWAY_DEMAND_ANNOTATION: new}, time.time())
    if waiting > 0:
        log.info("gateway demand", extra={"mdep": f"{namespace}/{name}", "waiting": waiting})
        await _tick(namespace, name)


@kopf.on.field(GROUP, VERSION, MDEP_PLURAL, field="spec.autoscaling.enabled", id="autoscaler-toggled")
def toggled(new: Any, namespace: str | None, name: str, body: Mapping[str, Any], **_: Any) -> None:
    """Autoscaling turned off: drop its status (and saved window) so nothing stale is shown or resumed."""
    if new or not (body.get("status") or {}).get("autoscaler"):
        return
    from kvfleet.operator import handlers as operator_handlers

    namespace = operator_handlers.namespaced(namespace)
    ref = {"apiVersion": API_VERSION, "kind": "ModelDeployment",
           "metadata": {"name": name, "namespace": namespace}}
    operator_handlers.kube().merge_patch(ref, {"status": {"autoscaler": None}}, "status")
    GAUGES.forget(namespace, name)
    log.info("autoscaling disabled", extra={"mdep": f"{namespace}/{name}"})


@kopf.on.delete(GROUP, VERSION, MDEP_PLURAL, optional=True, id="autoscaler-forget")
def forget(namespace: str | None, name: str, **_: Any) -> None:
    if namespace is not None:
        GAUGES.forget(namespace, name)
