"""Pure builders: typed spec in, Kubernetes object (plain dict) out. No I/O here."""
from .deployment import build_deployment, build_disruption_budget, build_service, deployment_name
from .meta import owner_reference
from .pod import build_engine_args, build_pod_template
from .tenant import build_cluster_queue, build_local_queue, build_namespace, build_network_policy, build_rbac
from .workload import build_workload, workload_hash, workload_name

__all__ = [
    "build_cluster_queue", "build_deployment", "build_disruption_budget", "build_engine_args", "build_local_queue",
    "build_namespace", "build_network_policy", "build_pod_template", "build_rbac", "build_service",
    "build_workload", "deployment_name", "owner_reference", "workload_hash", "workload_name",
]
