"""What the gateway knows of the cluster at one moment: immutable, swapped whole when anything changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kvfleet.gateway.catalog import Catalog
from kvfleet.gateway.keys import KeyTable
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.tenancy import DEFAULT_POLICY, TenantPolicy
from kvfleet.gateway.waking import ModelScale

NO_SCALE = ModelScale()


@dataclass(frozen=True)
class Snapshot:
    keys: KeyTable = field(default_factory=KeyTable)
    catalog: Catalog = field(default_factory=Catalog)
    replicas: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)  # model key -> ready replicas
    problems: tuple[str, ...] = ()  # what could not be used (missing Secrets, ambiguous keys), for the log
    scale: Mapping[str, ModelScale] = field(default_factory=dict)  # model key -> its autoscaling, status, capacity
    policies: Mapping[str, TenantPolicy] = field(default_factory=dict)  # tenant -> limits and weight
    peers: tuple[str, ...] = ()  # the other gateway replicas' metrics URLs (shared limits)

    def ready_replicas(self, model_key: str) -> tuple[Replica, ...]:
        return self.replicas.get(model_key, ())

    def model_scale(self, model_key: str) -> ModelScale:
        return self.scale.get(model_key, NO_SCALE)

    def policy(self, tenant: str) -> TenantPolicy:
        return self.policies.get(tenant, DEFAULT_POLICY)
