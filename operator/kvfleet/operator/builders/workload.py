"""One Kueue Workload per replica: a pod set of one pod carrying the replica's requests."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from ..config import OperatorConfig
from ..constants import (
    GPU_TOLERATION,
    KUEUE_API_VERSION,
    KUEUE_GROUP,
    LABEL_FLAVOR,
    LABEL_ORDINAL,
    LABEL_WORKLOAD_HASH,
    POD_SET_NAME,
)
from ..spec import ModelDeploymentSpec
from .meta import mdep_labels, owner_reference
from .pod import container_resources


def workload_name(mdep_name: str, ordinal: int) -> str:
    """Deterministic names: a restarted operator finds the same workloads and never duplicates."""
    return f"{mdep_name}-{ordinal}"


def workload_pod_template(
    spec: ModelDeploymentSpec, config: OperatorConfig, flavor_node_labels: Mapping[str, str] | None
) -> dict[str, Any]:
    """What Kueue needs to count and place the replica: requests, and the pinned flavor's labels.

    Kueue only assigns flavors whose nodeLabels match the pod set's nodeSelector, so a
    `gpuFlavor` in the spec pins the flavor through the node selector.
    """
    # No image: it does not change what Kueue counts, and a new image must roll the Deployment, not
    # replace admitted workloads (which would give their quota back to the queue).
    pod_spec: dict[str, Any] = {
        "containers": [{
            "name": "engine",
            "resources": {"requests": container_resources(spec)["requests"]},
        }],
        "tolerations": [dict(GPU_TOLERATION)],
    }
    if flavor_node_labels:
        pod_spec["nodeSelector"] = dict(flavor_node_labels)
    return {"spec": pod_spec}


def workload_hash(template: Mapping[str, Any], queue_name: str, priority: tuple[str, int] | None) -> str:
    """A short hash of what a Workload can't change once created (pod sets are immutable)."""
    blob = json.dumps([template, queue_name, list(priority) if priority else None], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_workload(
    mdep: Mapping[str, Any],
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    ordinal: int,
    queue_name: str,
    priority: tuple[str, int] | None = None,
    flavor_node_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The Workload (kueue.x-k8s.io/v1beta2) for replica `ordinal` of `mdep`.

    `priority` is (WorkloadPriorityClass name, its value): v1beta2 requires `spec.priority`
    next to `priorityClassRef`, and without Kueue's webhook nobody else fills it in.
    """
    name = mdep["metadata"]["name"]
    template = workload_pod_template(spec, config, flavor_node_labels)
    labels = {
        **mdep_labels(name, "workload"),
        LABEL_ORDINAL: str(ordinal),
        LABEL_WORKLOAD_HASH: workload_hash(template, queue_name, priority),
    }
    if spec.gpu_flavor:
        labels[LABEL_FLAVOR] = spec.gpu_flavor
    wl_spec: dict[str, Any] = {
        "queueName": queue_name,
        "active": True,
        "podSets": [{"name": POD_SET_NAME, "count": 1, "template": template}],
    }
    if priority is not None:
        wl_spec["priorityClassRef"] = {"group": KUEUE_GROUP, "kind": "WorkloadPriorityClass",
                                       "name": priority[0]}
        wl_spec["priority"] = int(priority[1])
    return {
        "apiVersion": KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(name, ordinal),
            "namespace": mdep["metadata"]["namespace"],
            "labels": labels,
            "ownerReferences": [owner_reference(mdep)],
        },
        "spec": wl_spec,
    }
