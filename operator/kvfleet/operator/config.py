"""Operator-wide settings (images, pod defaults), read once from the environment.

The Helm chart sets these variables from its values; a local run uses the defaults.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .constants import POD_SECURITY_LEVELS
from .gateway_access import GatewayIdentity


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class OperatorConfig:
    kvfleet_image: str = "ghcr.io/kvfleet/kvfleet-engine:0.1.0"
    vllm_image: str = "vllm/vllm-openai:v0.26.0"
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    # Seconds a model may take to load before the startup probe gives up (large models are slow).
    startup_timeout_seconds: int = 1800
    run_as_user: int = 1000
    model_cache_path: str = "/models"
    # Namespaces whose pods may reach every tenant's engines (the operator's own: its autoscaler scrapes
    # them; a Prometheus). The tenant NetworkPolicy admits them by name, as they may carry no label of ours.
    system_namespaces: tuple[str, ...] = ()
    # Node directories a `file://` model source may mount (read-only hostPath). Anything else is refused:
    # a tenant must not read the node's files (kubelet credentials, other pods' tokens).
    node_cache_roots: tuple[str, ...] = ("/var/cache/kvfleet",)
    # The Pod Security Standard tenant namespaces enforce (their pods: the engines). restricted admits every pod
    # the operator makes, except file:// sources (a hostPath volume), which only `privileged` admits.
    tenant_pod_security: str = "restricted"
    # The gateway's ServiceAccount (the chart's, when its gateway is enabled): models whose engines want their own
    # key get a GatewayKeyAccess condition saying whether it may read that key. None: no such condition.
    gateway: GatewayIdentity | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if env is None else env
        base = cls()
        return cls(
            kvfleet_image=env.get("KVFLEET_ENGINE_IMAGE", base.kvfleet_image),
            vllm_image=env.get("KVFLEET_VLLM_IMAGE", base.vllm_image),
            image_pull_policy=env.get("KVFLEET_IMAGE_PULL_POLICY", base.image_pull_policy),
            cluster_domain=env.get("KVFLEET_CLUSTER_DOMAIN", base.cluster_domain),
            startup_timeout_seconds=int(env.get("KVFLEET_STARTUP_TIMEOUT_SECONDS",
                                                base.startup_timeout_seconds)),
            run_as_user=int(env.get("KVFLEET_RUN_AS_USER", base.run_as_user)),
            model_cache_path=env.get("KVFLEET_MODEL_CACHE_PATH", base.model_cache_path),
            system_namespaces=_csv(env.get("KVFLEET_SYSTEM_NAMESPACES", "")),
            node_cache_roots=_csv(env["KVFLEET_NODE_CACHE_ROOTS"]) if "KVFLEET_NODE_CACHE_ROOTS" in env
            else base.node_cache_roots,
            tenant_pod_security=_pod_security(env.get("KVFLEET_TENANT_POD_SECURITY", base.tenant_pod_security)),
            gateway=GatewayIdentity.parse(env["KVFLEET_GATEWAY_SERVICE_ACCOUNT"])
            if env.get("KVFLEET_GATEWAY_SERVICE_ACCOUNT", "").strip() else None,
        )


def _pod_security(level: str) -> str:
    level = level.strip()
    if level not in POD_SECURITY_LEVELS:
        raise ValueError(f"KVFLEET_TENANT_POD_SECURITY must be one of restricted, baseline, privileged or empty "
                         f"(leave tenant namespaces unlabelled), got {level!r}")
    return level
