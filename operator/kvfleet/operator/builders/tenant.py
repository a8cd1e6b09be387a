"""What a Tenant becomes: namespaces, a ClusterQueue, and per namespace a LocalQueue,
a NetworkPolicy that keeps other tenants out, and a Role + RoleBinding for the tenant's group."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..constants import (
    GPU_RESOURCE,
    GROUP,
    KUEUE_API_VERSION,
    LABEL_MANAGED_BY,
    LABEL_SYSTEM_NAMESPACE,
    LABEL_TENANT,
    MANAGED_BY_VALUE,
    MDEP_PLURAL,
    POD_SECURITY_LABEL_PREFIX,
)
from ..spec import FlavorQuota, TenantSpec
from .meta import owner_reference

NETWORK_POLICY_NAME = "kvfleet-tenant-isolation"
ROLE_NAME = "kvfleet-modeldeployment-editor"


def tenant_labels(tenant_name: str) -> dict[str, str]:
    return {LABEL_TENANT: tenant_name, LABEL_MANAGED_BY: MANAGED_BY_VALUE}


def local_queue_name(tenant_name: str) -> str:
    """Every tenant namespace has one LocalQueue named after the tenant (the default queueName)."""
    return tenant_name


def pod_security_labels(level: str) -> dict[str, str]:
    """PodSecurity admission enforces `level` on the namespace's pods (and warns and audits at it); "" sets none."""
    if not level:
        return {}
    labels = {f"{POD_SECURITY_LABEL_PREFIX}{mode}": level for mode in ("enforce", "warn", "audit")}
    return {**labels, **{f"{POD_SECURITY_LABEL_PREFIX}{mode}-version": "latest" for mode in ("enforce", "warn",
                                                                                           "audit")}}


def build_namespace(tenant_name: str, namespace: str, pod_security: str = "restricted") -> dict[str, Any]:
    """The namespace with the tenant label (the ClusterQueue and NetworkPolicy select on it) and the Pod Security
    Standard its pods must meet.

    No owner reference: deleting a Tenant must not delete its teams' namespaces and data.
    """
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "labels": {**tenant_labels(tenant_name),
                                                       **pod_security_labels(pod_security)}}}


def _flavor_quotas(q: FlavorQuota) -> dict[str, Any]:
    gpu: dict[str, Any] = {"name": GPU_RESOURCE, "nominalQuota": q.nominal}
    if q.borrowing_limit is not None:
        gpu["borrowingLimit"] = q.borrowing_limit
    if q.lending_limit is not None:
        gpu["lendingLimit"] = q.lending_limit
    # Kueue refuses a workload asking for a resource its ClusterQueue does not cover, so cpu and
    # memory are covered too (generous defaults: the tenant's limit is the GPUs).
    return {"name": q.flavor, "resources": [
        {"name": "cpu", "nominalQuota": q.cpu},
        {"name": "memory", "nominalQuota": q.memory},
        gpu,
    ]}


def build_cluster_queue(tenant: Mapping[str, Any], spec: TenantSpec) -> dict[str, Any]:
    """The tenant's ClusterQueue: GPU quota per flavor, cohort, fair-sharing weight, preemption."""
    name = tenant["metadata"]["name"]
    cq_spec: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {LABEL_TENANT: name}},
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [{
            "coveredResources": ["cpu", "memory", GPU_RESOURCE],
            "flavors": [_flavor_quotas(q) for q in spec.quotas],
        }],
        "fairSharing": {"weight": spec.fair_sharing_weight},
        "preemption": {"reclaimWithinCohort": spec.reclaim_within_cohort,
                       "withinClusterQueue": spec.within_cluster_queue},
    }
    if spec.cohort:
        cq_spec["cohortName"] = spec.cohort
    return {
        "apiVersion": KUEUE_API_VERSION, "kind": "ClusterQueue",
        "metadata": {"name": name, "labels": tenant_labels(name),
                     "ownerReferences": [owner_reference(tenant)]},
        "spec": cq_spec,
    }


def build_local_queue(tenant: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    name = tenant["metadata"]["name"]
    return {
        "apiVersion": KUEUE_API_VERSION, "kind": "LocalQueue",
        "metadata": {"name": local_queue_name(name), "namespace": namespace, "labels": tenant_labels(name),
                     "ownerReferences": [owner_reference(tenant)]},
        "spec": {"clusterQueue": name},
    }


def build_network_policy(tenant: Mapping[str, Any], namespace: str,
                         system_namespaces: Sequence[str] = ()) -> dict[str, Any]:
    """Ingress only from this tenant's namespaces and from system namespaces (operator, metrics): those
    labelled `serving.kvfleet.dev/system=true` and those named in `system_namespaces` (the operator's own,
    so its autoscaler can scrape the engines without anyone labelling its namespace)."""
    name = tenant["metadata"]["name"]
    by_name = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
               for ns in sorted(set(system_namespaces))]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": NETWORK_POLICY_NAME, "namespace": namespace, "labels": tenant_labels(name),
                     "ownerReferences": [owner_reference(tenant)]},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [
                {"namespaceSelector": {"matchLabels": {LABEL_TENANT: name}}},
                {"namespaceSelector": {"matchLabels": {LABEL_SYSTEM_NAMESPACE: "true"}}},
                *by_name,
            ]}],
        },
    }


def build_rbac(tenant: Mapping[str, Any], spec: TenantSpec, namespace: str) -> list[dict[str, Any]]:
    """A Role that manages ModelDeployments in `namespace` only, bound to the tenant's group."""
    name = tenant["metadata"]["name"]
    meta = {"namespace": namespace, "labels": tenant_labels(name), "ownerReferences": [owner_reference(tenant)]}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": ROLE_NAME, **meta},
        "rules": [
            {"apiGroups": [GROUP], "resources": [MDEP_PLURAL, f"{MDEP_PLURAL}/scale"],
             "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            # Only verbs the operator holds itself (RBAC forbids granting more); status is read with get.
            {"apiGroups": [GROUP], "resources": [f"{MDEP_PLURAL}/status"], "verbs": ["get"]},
        ],
    }
    if not spec.group:
        return [role]
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": ROLE_NAME, **meta},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE_NAME},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": spec.group}],
    }
    return [role, binding]
