"""A snapshot from a file instead of the API server: for running the gateway outside Kubernetes (a
laptop, tests, benchmarks). Same decisions, same routing; nothing is watched.

    tenants:
      team-a:
        keys: [a-key-of-at-least-16-chars]
        weight: 1                        # as a Tenant's spec.gateway: fair-share weight and limits
        limits: {requestsPerMinute: 600, tokensPerMinute: 100000, maxConcurrentRequests: 16}
        models:
          chat:                          # the served name: what clients send and the engines serve
            engineKind: kvfleet          # or vllm (metric names)
            maxNumSeqs: 4                # requests one replica runs at once (saturation); optional
            sharedWith: [team-b]         # other tenants whose keys reach this model too; optional
            apiKey: the-engines-own-key  # the key its engines want (`--api-key`); optional
            replicas: [http://127.0.0.1:8001, http://127.0.0.1:8002]
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.engine_key_store import EngineKeyStore, fixed_reader
from kvfleet.gateway.engine_keys import EngineKeyRef
from kvfleet.gateway.keys import SecretRef, build_key_table
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.tenancy import TenantPolicy, tenant_policy
from kvfleet.gateway.waking import ModelScale


class StaticConfigError(ValueError):
    pass


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StaticConfigError(f"{where}: expected a mapping")
    return value


def _api_key(spec: Mapping[str, Any], where: str) -> str | None:
    key = spec.get("apiKey")
    if key is not None and (not isinstance(key, str) or not key.strip()):
        raise StaticConfigError(f"{where}.apiKey: expected a non-empty string")
    return key.strip() if key else None


def _key_ref(tenant: Any, model_id: Any, spec: Mapping[str, Any]) -> EngineKeyRef:
    """Where a static model's engine key is, as its ModelRef carries it."""
    return EngineKeyRef(str(tenant), str(model_id), "apiKey", str(spec.get("engineKind", "kvfleet")))


def static_engine_keys(config: Mapping[str, Any]) -> dict[EngineKeyRef, str]:
    """The models' `apiKey`s (of a config `static_snapshot` accepted), by the ref their ModelRef carries."""
    keys = {}
    for tenant, body in config["tenants"].items():
        for model_id, spec in (body.get("models") or {}).items():
            key = _api_key(spec, f"tenants.{tenant}.models.{model_id}")
            if key is not None:
                keys[_key_ref(tenant, model_id, spec)] = key
    return keys


def static_snapshot(config: Mapping[str, Any], source: str = "config") -> Snapshot:
    tenants = _mapping(config.get("tenants"), f"{source}: tenants")
    refs: dict[str, list[SecretRef]] = {}
    secrets: dict[SecretRef, dict[str, str]] = {}
    models: list[ModelRef] = []
    replicas: dict[str, tuple[Replica, ...]] = {}
    scale: dict[str, ModelScale] = {}
    policies: dict[str, TenantPolicy] = {}
    for tenant, body in tenants.items():
        body = _mapping(body, f"{source}: tenants.{tenant}")
        keys = body.get("keys") or []
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise StaticConfigError(f"{source}: tenants.{tenant}.keys: expected a list of strings")
        ref = SecretRef("static", tenant)
        refs[tenant] = [ref]
        secrets[ref] = {f"key{i}": base64.b64encode(k.encode()).decode() for i, k in enumerate(keys)}
        policies[str(tenant)] = tenant_policy(body)
        for model_id, spec in _mapping(body.get("models") or {}, f"{source}: tenants.{tenant}.models").items():
            spec = _mapping(spec, f"{source}: tenants.{tenant}.models.{model_id}")
            shared = spec.get("sharedWith") or []
            if not isinstance(shared, list) or not all(isinstance(t, str) for t in shared):
                raise StaticConfigError(f"{source}: tenants.{tenant}.models.{model_id}.sharedWith: expected a list "
                                        "of tenant names")
            unknown = sorted(set(shared) - set(tenants))
            if unknown:
                raise StaticConfigError(f"{source}: tenants.{tenant}.models.{model_id}.sharedWith: no tenant "
                                        f"{', '.join(unknown)}")
            seqs = spec.get("maxNumSeqs")
            if seqs is not None and (isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1):
                raise StaticConfigError(f"{source}: tenants.{tenant}.models.{model_id}.maxNumSeqs: expected an "
                                        "integer >= 1")
            kind = str(spec.get("engineKind", "kvfleet"))
            key_ref = _key_ref(tenant, model_id, spec) \
                if _api_key(spec, f"{source}: tenants.{tenant}.models.{model_id}") is not None else None
            ref_model = ModelRef(tenant=tenant, namespace=tenant, deployment=str(model_id), served_name=str(model_id),
                                 engine_kind=kind, shared_with=tuple(sorted(set(shared) - {tenant})),
                                 engine_key=key_ref)
            urls = spec.get("replicas") or []
            if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith("http://") for u in urls):
                raise StaticConfigError(f"{source}: tenants.{tenant}.models.{model_id}.replicas: expected http:// URLs")
            models.append(ref_model)
            replicas[ref_model.key] = tuple(Replica(u.rstrip("/"), u.rstrip("/"), urlsplit(u).hostname or "")
                                            for u in urls)
            scale[ref_model.key] = ModelScale(desired=len(urls), admitted=len(urls), ready=len(urls), capacity=seqs)
    table, problems = build_key_table(refs, secrets)
    if problems:
        raise StaticConfigError(f"{source}: " + "; ".join(problems))
    return Snapshot(keys=table, catalog=build_catalog(models), replicas=replicas, scale=scale, policies=policies)


class StaticSource:
    def __init__(self, path: str) -> None:
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise StaticConfigError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from None
        self.snapshot = static_snapshot(_mapping(config, path), path)
        self.engine_keys = EngineKeyStore(fixed_reader(static_engine_keys(config)))
        self.synced = True

    async def run(self) -> None:
        return None

    async def close(self) -> None:
        return None
