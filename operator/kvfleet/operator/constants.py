"""Names shared by the operator's builders, plans and handlers (one place, no magic strings)."""
from __future__ import annotations

GROUP = "serving.kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MDEP_KIND = "ModelDeployment"
MDEP_PLURAL = "modeldeployments"
TENANT_KIND = "Tenant"
TENANT_PLURAL = "tenants"

KUEUE_GROUP = "kueue.x-k8s.io"
# The storage version of the Kueue we run (0.16+): never mix versions, there is no conversion webhook.
KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"

# One field manager for every server-side apply the operator makes.
FIELD_MANAGER = "kvfleet-operator"

GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_PORT = 8000
POD_SET_NAME = "main"

# Labels the operator puts on what it owns (selectors and watches rely on them).
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "kvfleet-operator"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MDEP = f"{GROUP}/modeldeployment"
LABEL_TENANT = f"{GROUP}/tenant"
LABEL_ORDINAL = f"{GROUP}/replica"
LABEL_FLAVOR = f"{GROUP}/flavor"
LABEL_WORKLOAD_HASH = f"{GROUP}/workload-hash"
# Namespaces labelled with this may reach every tenant (the operator's own, monitoring).
LABEL_SYSTEM_NAMESPACE = f"{GROUP}/system"

# Pod Security Standards (Kubernetes' PodSecurity admission) the operator may enforce on tenant namespaces; ""
# leaves their labels alone. Only `privileged` admits hostPath volumes (file:// model sources).
POD_SECURITY_LEVELS = ("restricted", "baseline", "privileged", "")
POD_SECURITY_LABEL_PREFIX = "pod-security.kubernetes.io/"

# Kueue's usual toleration for GPU nodes; kept on both the workload and the pods so flavor
# matching and scheduling agree.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}

# Written on a ModelDeployment by the gateway: requests waiting there for a replica (JSON {"waiting": N, "at": unix
# seconds}). The autoscaler adds a fresh value to the engines' queue depth: how a model at zero wakes up. Not under
# GROUP: kopf keeps its own state in `serving.kvfleet.dev/` annotations and leaves that prefix out of what it diffs,
# so a change there would never reach the autoscaler's field handler.
GATEWAY_DEMAND_ANNOTATION = "gateway.kvfleet.dev/demand"
