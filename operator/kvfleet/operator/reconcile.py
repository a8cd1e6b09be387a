"""Reconcile one ModelDeployment: read what is, plan purely, write what must change.

All API I/O of a ModelDeployment's reconciliation is in this module; every decision is
made by the pure functions it calls (spec, builders, plan, status).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from .applied import AppliedOnce, unchanged, with_hash
from .builders import build_deployment, build_disruption_budget, build_service, build_workload, workload_hash
from .builders.deployment import endpoint_url
from .builders.meta import selector_labels
from .builders.tenant import local_queue_name
from .builders.workload import workload_pod_template
from .config import OperatorConfig
from .constants import (
    API_VERSION,
    KUEUE_API_VERSION,
    LABEL_FLAVOR,
    LABEL_MDEP,
    LABEL_WORKLOAD_HASH,
    MDEP_PLURAL,
)
from .errors import SpecError
from .events import build_event
from .gateway_access import KeyAccess, access_check_failed, access_review, key_access
from .kube import Kube, KubeError
from .kueue_state import observe_workload
from .plan import WorkloadPlan, frozen_plan, plan_deployment_replicas, plan_workloads
from .refs import ApiRefs, Refs
from .scaling import desired_replicas_for
from .spec import ModelDeploymentSpec, check_node_path, parse_model_deployment
from .status import Observation, compute_status, status_changed, status_event

log = logging.getLogger("kvfleet.operator.reconcile")


def utcnow() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Resolved:
    queue_name: str
    priority: tuple[str, int] | None
    flavors: dict[str, Mapping[str, Any]]  # ResourceFlavor name -> spec, of the flavors this reconcile places on


def resolve(refs: Refs, namespace: str, spec: ModelDeploymentSpec, placed: Iterable[str] = ()) -> Resolved:
    """Look up what the spec refers to, and the flavors of `placed` (those workloads were admitted with); a
    missing reference is a SpecError with its reason."""
    flavors: dict[str, Mapping[str, Any]] = {}
    if spec.gpu_flavor:
        pinned = refs.flavor(spec.gpu_flavor)
        if pinned is None:
            raise SpecError("spec.resources.gpuFlavor", f"ResourceFlavor {spec.gpu_flavor!r} does not exist",
                            "FlavorNotFound")
        flavors[spec.gpu_flavor] = pinned
    for name in set(placed) - set(flavors):
        found = refs.flavor(name)
        if found is not None:
            flavors[name] = found
    queue = spec.queue_name
    if queue is None:
        tenant = refs.namespace_tenant(namespace)
        if not tenant:
            raise SpecError("spec.queueName", f"namespace {namespace!r} belongs to no Tenant; set "
                            "spec.queueName or add the namespace to a Tenant", "NotATenantNamespace")
        queue = local_queue_name(tenant)
    if not refs.local_queue_exists(namespace, queue):
        raise SpecError("spec.queueName", f"LocalQueue {queue!r} does not exist in {namespace!r}",
                        "QueueNotFound")
    priority = None
    if spec.priority_class_name:
        value = refs.priority_value(spec.priority_class_name)
        if value is None:
            raise SpecError("spec.priorityClassName", f"WorkloadPriorityClass {spec.priority_class_name!r} "
                            "does not exist", "PriorityClassNotFound")
        priority = (spec.priority_class_name, value)
    return Resolved(queue, priority, flavors)


def _flavor_placement(flavor_spec: Mapping[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]]]:
    return dict(flavor_spec.get("nodeLabels") or {}), list(flavor_spec.get("tolerations") or [])


Written = Callable[[Mapping[str, Any]], None]


def _ignore(_: Mapping[str, Any]) -> None:
    pass


def _apply_deployments(kube: Kube, config: OperatorConfig, mdep: dict[str, Any], spec: ModelDeploymentSpec,
                       resolved: Resolved, plan: WorkloadPlan, deployments: list[dict[str, Any]],
                       spec_hash: str, written: Written) -> None:
    """Each shape's Deployment to the number of workloads admitted with that shape."""
    namespace = mdep["metadata"]["namespace"]
    existing: dict[tuple[str, str], dict[str, Any]] = {}
    for d in deployments:
        dep_labels = d["metadata"].get("labels") or {}
        if dep_labels.get(LABEL_FLAVOR):
            existing[(dep_labels[LABEL_FLAVOR], dep_labels.get(LABEL_WORKLOAD_HASH, ""))] = d
    for (flavor, shape), replicas in plan_deployment_replicas(plan.admitted_by_shape, existing).items():
        if shape == spec_hash:
            node_labels, tolerations = _flavor_placement(resolved.flavors.get(flavor, {}))
            desired = with_hash(build_deployment(mdep, spec, config, flavor, replicas, node_labels, tolerations,
                                                 shape))
            live = existing.get((flavor, shape))
            if not unchanged(live, desired):
                result = apply_repairing(kube, mdep, desired)
                if live is None:
                    written(result)
        elif (flavor, shape) in existing:
            # An older shape keeps its template (its pods match their admitted workloads) and only
            # shrinks as those workloads are replaced.
            old_name = existing[(flavor, shape)]["metadata"]["name"]
            if replicas == 0:
                kube.delete("apps/v1", "deployments", old_name, namespace)
            elif (existing[(flavor, shape)].get("spec") or {}).get("replicas") != replicas:
                ref = {"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": old_name, "namespace": namespace}}
                kube.merge_patch(ref, {"spec": {"replicas": replicas}})
        # else: admitted with an old shape whose Deployment is gone; it runs once replaced.


def fixed_children(mdep: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """What a ModelDeployment owns that is built from its name and uid alone (applied once per process): the
    Service in front of its replicas and their PodDisruptionBudget."""
    return build_service(mdep), build_disruption_budget(mdep)


def reconcile_model_deployment(kube: Kube, config: OperatorConfig, namespace: str, name: str,
                               applied: AppliedOnce | None = None, refs: Refs | None = None,
                               written: Written = _ignore) -> dict | None:
    """Converge one ModelDeployment; returns the status written (or None if it is gone). `applied` remembers
    the Services already applied by this process (their content never changes), so they are applied once;
    `refs` looks up what the spec refers to (default: the apiserver, each time); `written` is told each Workload
    and Deployment this pass created, as the apiserver returned it (so the watch's echo of it needs no pass: this
    pass already counted it as new; an update's answer may carry status this pass did not see, so not those)."""
    mdep = kube.get(API_VERSION, MDEP_PLURAL, name, namespace)
    if mdep is None or mdep["metadata"].get("deletionTimestamp"):
        return None  # the garbage collector removes what it owned
    old_status = mdep.get("status") or {}
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
    workloads = kube.list(KUEUE_API_VERSION, "workloads", namespace, f"{LABEL_MDEP}={name}")
    deployments = kube.list("apps/v1", "deployments", namespace, f"{LABEL_MDEP}={name}")
    observed = [observe_workload(w) for w in workloads]
    problem: SpecError | None = None
    desired = 0
    plan: WorkloadPlan
    gateway_key: KeyAccess | None = None
    try:
        spec = parse_model_deployment(mdep.get("spec") or {})
        gateway_key = gateway_key_access(kube, config, namespace, spec)
        check_node_path(spec.source, config.node_cache_roots, config.tenant_pod_security)
        desired = desired_replicas_for(spec, old_status.get("autoscaler"))
        resolved = resolve(refs or ApiRefs(kube), namespace, spec, {w.flavor for w in observed if w.flavor})
    except SpecError as exc:
        problem = exc
        plan = frozen_plan(desired, observed)
    else:
        pinned = resolved.flavors.get(spec.gpu_flavor, {}).get("nodeLabels") if spec.gpu_flavor else None
        template = workload_pod_template(spec, config, pinned)
        spec_hash = workload_hash(template, resolved.queue_name, resolved.priority)
        plan = plan_workloads(desired, observed, spec_hash)
        fixed_key = (namespace, name, str(mdep["metadata"].get("uid")))
        memo = applied if applied is not None else AppliedOnce()  # a fresh one: applied every pass
        ticket = memo.needed(fixed_key)
        if ticket is not None:
            for fixed in fixed_children(mdep):
                apply_repairing(kube, mdep, fixed)
            memo.done(ticket)
        _apply_deployments(kube, config, mdep, spec, resolved, plan, deployments, spec_hash, written)
        # Pods go first (above), then the quota: a freed GPU is never still in use by us.
        for wl_name in plan.delete:
            kube.delete(KUEUE_API_VERSION, "workloads", wl_name, namespace)
        for ordinal in plan.create:
            written(kube.apply(build_workload(mdep, spec, config, ordinal, resolved.queue_name, resolved.priority,
                                              pinned)))
        if plan.create or plan.delete:
            log.info("workloads mdep=%s/%s desired=%d created=%s deleted=%s", namespace, name, desired,
                     list(plan.create), list(plan.delete))
    obs = Observation(
        generation=int(mdep["metadata"].get("generation", 0)),
        desired=desired,
        plan=plan,
        pod_replicas=sum(int((d.get("status") or {}).get("replicas", 0)) for d in deployments),
        ready_replicas=sum(int((d.get("status") or {}).get("readyReplicas", 0)) for d in deployments),
        endpoint=endpoint_url(name, namespace, config.cluster_domain),
        selector=selector,
        problem=problem,
        gateway_key=gateway_key,
    )
    now = utcnow()
    new_status = compute_status(obs, old_status, now)
    if status_changed(old_status, new_status):
        kube.merge_patch(mdep, {"status": new_status}, subresource="status")
        event = status_event(old_status.get("conditions") or [], new_status["conditions"])
        if event is not None:
            post_event(kube, build_event(mdep, *event, now))
    return new_status


def apply_repairing(kube: Kube, mdep: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply `child` (which `mdep` owns); when someone else's edit makes that apply invalid, put its
    spec back whole, and say so in an Event on `mdep`. -> the applied object.

    Apply merges list entries by key, so an entry whose key another manager changed stays theirs beside ours: a
    Service port or a container port whose number someone changed keeps the name `http`, and our entry would
    repeat the name (422, every retry alike). A merge patch replaces lists whole; the apply after it owns every
    field again."""
    try:
        return kube.apply(child)
    except KubeError as exc:
        if exc.status != 422:
            raise
        refused = str(exc)
    kind, name = child["kind"], child["metadata"]["name"]
    kube.merge_patch(child, {"spec": child["spec"]})
    result = kube.apply(child)
    log.warning("repaired %s %s/%s: %s", kind, child["metadata"].get("namespace"), name, refused[:300])
    post_event(kube, build_event(mdep, "Warning", "ChildRepaired",
                                 f"{kind} {name} put back: an edit by someone else made the operator's apply "
                                 f"invalid ({refused[:300]})", utcnow()))
    return result


def gateway_key_access(kube: Kube, config: OperatorConfig, namespace: str,
                       spec: ModelDeploymentSpec) -> KeyAccess | None:
    """Whether the gateway may read the engines' own key (None: they want none, or there is no gateway)."""
    if config.gateway is None or not spec.api_key_secret:
        return None
    try:
        review = kube.create(access_review(config.gateway, namespace, spec.api_key_secret))
    except KubeError as exc:
        return access_check_failed(spec.api_key_secret, str(exc)[:200])
    return key_access(review, config.gateway, namespace, spec.api_key_secret)


def post_event(kube: Kube, event: dict[str, Any]) -> None:
    """Post an Event; one that cannot be posted (its namespace is being deleted, the apiserver refuses it) is
    worth a log line, not a failed reconcile: the status it reports is already written."""
    try:
        kube.create(event)
    except KubeError as exc:
        log.warning("event %s/%s not posted: %s", event["metadata"]["namespace"], event["reason"], exc)
