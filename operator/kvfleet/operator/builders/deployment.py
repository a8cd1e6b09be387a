"""The Deployment that runs the admitted replicas of one flavor, the Service in front, and the disruption budget."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..config import OperatorConfig
from ..constants import ENGINE_PORT, LABEL_FLAVOR, LABEL_WORKLOAD_HASH
from ..spec import ModelDeploymentSpec
from .meta import owned_metadata, selector_labels
from .pod import build_pod_template


def deployment_name(mdep_name: str, flavor: str, shape_hash: str) -> str:
    """One Deployment per shape: the assigned flavor (its node selector) and the workload hash (the
    requests Kueue admitted), so pods of one shape only ever run for workloads of that shape."""
    return f"{mdep_name}-{flavor}-{shape_hash[:6]}" if shape_hash else f"{mdep_name}-{flavor}"


def build_deployment(
    mdep: Mapping[str, Any],
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    flavor: str,
    replicas: int,
    node_labels: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    shape_hash: str = "",
) -> dict[str, Any]:
    """A Deployment of `replicas` pods (= workloads admitted with `flavor`) on the flavor's nodes.

    maxSurge 0: a rollout never runs more pods than admitted workloads, so the quota Kueue
    granted is never exceeded, not even for a moment.
    """
    name = mdep["metadata"]["name"]
    shape = {LABEL_FLAVOR: flavor, LABEL_WORKLOAD_HASH: shape_hash}
    selector = {**selector_labels(name), **shape}
    template = build_pod_template(name, spec, config, node_labels, tolerations, shape)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(mdep, deployment_name(name, flavor, shape_hash), "engine", shape),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": config.startup_timeout_seconds + 120,
            "template": template,
        },
    }


def build_service(mdep: Mapping[str, Any]) -> dict[str, Any]:
    """The ClusterIP Service behind the endpoint; it selects the pods of every flavor."""
    name = mdep["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(mdep, name, "service"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_disruption_budget(mdep: Mapping[str, Any]) -> dict[str, Any]:
    """A PodDisruptionBudget over the replicas of every flavor: a node drain (`kubectl drain`, a cluster
    upgrade) evicts one of them at a time, waiting for its replacement to be Ready, instead of taking the model
    down. Pods that are not Ready (loading, failing) may always be evicted, so they never block a drain; the
    operator's own scale-downs, rollouts and Kueue's preemptions delete rather than evict and are not held back."""
    name = mdep["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_metadata(mdep, name, "disruption-budget"),
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def endpoint_url(mdep_name: str, namespace: str, cluster_domain: str) -> str:
    """The in-cluster OpenAI base URL of the Service."""
    return f"http://{mdep_name}.{namespace}.svc.{cluster_domain}:{ENGINE_PORT}/v1"
