"""Which models a tenant sees, and what a request's `model` names.

A tenant's models are the ModelDeployments in its namespaces. A model's public id is its served name
(`spec.model.servedName`) when no other model of the same tenant serves that name; two tenants may both
call a model `chat`, since ids resolve within the caller's tenant only. Every model also answers to
`<namespace>/<ModelDeployment name>`, unique in the cluster; a served name that two models of one
tenant share resolves to neither (the error lists the qualified ids) and those models are listed under
their qualified ids. A model its owner shares (`spec.gateway.sharedWith` of the ModelDeployment) is
also one of each named tenant's models, by the same rules; it stays its owner's (`owned_by`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from kvfleet.gateway.engine_keys import EngineKeyRef


@dataclass(frozen=True)
class ModelRef:
    """One ModelDeployment as the gateway routes to it."""

    tenant: str
    namespace: str
    deployment: str  # the ModelDeployment's name
    served_name: str  # what its engines serve: the `model` sent upstream
    engine_kind: str = "kvfleet"
    created: int = 0  # unix seconds
    source: str | None = None
    shared_with: tuple[str, ...] = ()  # other tenants that may use it (their keys reach it too)
    engine_key: EngineKeyRef | None = None  # where its engines' own key is (spec.apiKeySecretRef), if they want one

    @property
    def key(self) -> str:
        """`namespace/deployment`: unique in the cluster, keys the replica table and the qualified id."""
        return f"{self.namespace}/{self.deployment}"


@dataclass(frozen=True)
class TenantModels:
    by_id: Mapping[str, ModelRef] = field(default_factory=dict)  # every id that resolves
    listed: tuple[tuple[str, ModelRef], ...] = ()  # (id, model) as /v1/models shows them
    ambiguous: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # served name -> qualified ids


@dataclass(frozen=True)
class Resolution:
    model: ModelRef | None
    message: str = ""  # why not, when model is None


@dataclass(frozen=True)
class Catalog:
    tenants: Mapping[str, TenantModels] = field(default_factory=dict)

    def models(self, tenant: str) -> tuple[tuple[str, ModelRef], ...]:
        entry = self.tenants.get(tenant)
        return entry.listed if entry else ()

    def resolve(self, tenant: str, model_id: str) -> Resolution:
        entry = self.tenants.get(tenant) or TenantModels()
        found = entry.by_id.get(model_id)
        if found is not None:
            return Resolution(found)
        if model_id in entry.ambiguous:
            ids = ", ".join(f"`{i}`" for i in entry.ambiguous[model_id])
            return Resolution(None, f"The model `{model_id}` is served by several of your ModelDeployments; "
                                    f"name one of {ids}.")
        return Resolution(None, f"The model `{model_id}` does not exist or you do not have access to it.")


def build_catalog(models: Iterable[ModelRef]) -> Catalog:
    per_tenant: dict[str, list[ModelRef]] = {}
    for m in models:
        for user in dict.fromkeys((m.tenant, *m.shared_with)):
            per_tenant.setdefault(user, []).append(m)
    out: dict[str, TenantModels] = {}
    for tenant, refs in per_tenant.items():
        refs.sort(key=lambda m: (m.served_name, m.key))
        by_served: dict[str, list[ModelRef]] = {}
        for m in refs:
            by_served.setdefault(m.served_name, []).append(m)
        by_id: dict[str, ModelRef] = {m.key: m for m in refs}
        listed: list[tuple[str, ModelRef]] = []
        ambiguous: dict[str, tuple[str, ...]] = {}
        for served, group in by_served.items():
            if len(group) == 1:
                by_id[served] = group[0]
                listed.append((served, group[0]))
            else:
                ambiguous[served] = tuple(m.key for m in group)
                listed += [(m.key, m) for m in group]
        out[tenant] = TenantModels(by_id, tuple(listed), ambiguous)
    return Catalog(out)
