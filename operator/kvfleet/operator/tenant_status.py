"""Tenant status: GPUs in use and pending per flavor, from the Workloads in its namespaces."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .constants import LABEL_FLAVOR
from .kueue_state import observe_workload
from .spec import TenantSpec
from .status import set_condition

ANY_FLAVOR = "*"


def gpu_usage(workloads: Sequence[Mapping[str, Any]], spec: TenantSpec) -> list[dict[str, Any]]:
    """Per flavor: GPUs of admitted workloads (by assigned flavor) and of pending ones.

    A pending workload has no flavor yet: it counts under the flavor it is pinned to
    (the kvfleet flavor label) or under `*` when any flavor would do.
    """
    usage: dict[str, dict[str, int]] = {q.flavor: {"inUse": 0, "pending": 0} for q in spec.quotas}
    for wl in workloads:
        w = observe_workload(wl)
        if w.terminating or w.gpus == 0:
            continue
        if w.running_allowed:
            usage.setdefault(w.flavor or ANY_FLAVOR, {"inUse": 0, "pending": 0})["inUse"] += w.gpus
        elif not w.evicted:
            pinned = ((wl.get("metadata") or {}).get("labels") or {}).get(LABEL_FLAVOR) or ANY_FLAVOR
            usage.setdefault(pinned, {"inUse": 0, "pending": 0})["pending"] += w.gpus
    nominal = {q.flavor: q.nominal for q in spec.quotas}
    return [{"flavor": f, "nominal": nominal.get(f, 0), **u} for f, u in sorted(usage.items())]


def namespace_conflicts(tenant_name: str, owners: Mapping[str, str | None], live_tenants: set[str]) -> dict[str, str]:
    """Namespaces (-> other tenant) already labelled for another Tenant that still exists: not taken over."""
    return {ns: owner for ns, owner in owners.items()
            if owner and owner != tenant_name and owner in live_tenants}


def compute_tenant_status(tenant: Mapping[str, Any], spec: TenantSpec | None, problem: str | None,
                          workloads: Sequence[Mapping[str, Any]], now: str,
                          conflicts: Mapping[str, str] | None = None,
                          reserved: Sequence[str] = ()) -> dict[str, Any]:
    """`conflicts`: namespaces (-> owner) another tenant holds; `reserved`: namespaces of the platform
    (the operator's own and the chart's allowNamespaces), never given to a tenant. Neither is configured."""
    old = (tenant.get("status") or {}).get("conditions") or ()
    generation = int((tenant.get("metadata") or {}).get("generation", 0))
    if spec is None or problem:
        ready = set_condition(old, "Ready", False, "InvalidSpec", problem or "invalid spec", generation, now)
        return {"conditions": [ready], "observedGeneration": generation, "gpus": []}
    conflicts = conflicts or {}
    served = [ns for ns in spec.namespaces if ns not in conflicts and ns not in reserved]
    problems = []
    if reserved:
        problems.append(f"reserved for the platform (the kvfleet operator's or a system namespace): "
                        f"{', '.join(sorted(reserved))}")
    if conflicts:
        taken = ", ".join(f"{ns} (tenant {owner})" for ns, owner in sorted(conflicts.items()))
        problems.append(f"already belong to another tenant: {taken}")
    if problems:
        reason = "ReservedNamespace" if reserved else "NamespaceConflict"
        ready = set_condition(old, "Ready", False, reason, "spec.namespaces: " + "; ".join(problems), generation, now)
    else:
        ready = set_condition(old, "Ready", True, "Reconciled",
                              f"ClusterQueue and {len(served)} namespace(s) configured", generation, now)
    return {
        "conditions": [ready],
        "observedGeneration": generation,
        "clusterQueue": tenant["metadata"]["name"],
        "namespaces": served,
        "gpus": gpu_usage(workloads, spec),
    }


def usage_refresh(old_status: Mapping[str, Any], fresh: Mapping[str, Any]) -> dict[str, Any]:
    """The status a status-only pass writes (an admission changed the tenant's GPU usage): the usage from
    `fresh`, everything else as the last full pass left it. Only a pass that applied the spec (the ClusterQueue's
    quota above all) may advance observedGeneration: clients wait on it to know a quota cut holds, and a full pass
    that failed (the apiserver restarting) must not be vouched for by a usage refresh in between. A tenant no full
    pass has written yet gets `fresh` as it is."""
    if old_status.get("observedGeneration") is None:
        return dict(fresh)
    return {**{k: old_status[k] for k in fresh if k in old_status}, "gpus": fresh.get("gpus", [])}
