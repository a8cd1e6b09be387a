"""A snapshot from a file instead of the API server: for running the gateway outside Kubernetes (a
laptop, tests, benchmarks). Same decisions, same routing; nothing is watched.

    tenants:
      team-a:
        keys: [a-key-of-at-least-16-chars]
        models:
          chat:                          # the served name: what clients send and the engines serve
            engineKind: kvfleet          # or vllm (metric names)
            replicas: [http://127.0.0.1:8001, http://127.0.0.1:8002]
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.keys import SecretRef, build_key_table
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.snapshot import Snapshot


class StaticConfigError(ValueError):
    pass


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise StaticConfigError(f"{where}: expected a mapping")
    return value


def static_snapshot(config: Mapping[str, Any], source: str = "config") -> Snapshot:
    tenants = _mapping(config.get("tenants"), f"{source}: tenants")
    refs: dict[str, list[SecretRef]] = {}
    secrets: dict[SecretRef, dict[str, str]] = {}
    models: list[ModelRef] = []
    replicas: dict[str, tuple[Replica, ...]] = {}
    for tenant, body in tenants.items():
        body = _mapping(body, f"{source}: tenants.{tenant}")
        keys = body.get("keys") or []
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise StaticConfigError(f"{source}: tenants.{tenant}.keys: expected a list of strings")
        ref = SecretRef("static", tenant)
        refs[tenant] = [ref]
        secrets[ref] = {f"key{i}": base64.b64encode(k.encode()).decode() for i, k in enumerate(keys)}
        for model_id, spec in _mapping(body.get("models") or {}, f"{source}: tenants.{tenant}.models").items():
            spec = _mapping(spec, f"{source}: tenants.{tenant}.models.{model_id}")
            ref_model = ModelRef(tenant=tenant, namespace=tenant, deployment=str(model_id), served_name=str(model_id),
                                 engine_kind=str(spec.get("engineKind", "kvfleet")))
            urls = spec.get("replicas") or []
            if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith("http://") for u in urls):
                raise StaticConfigError(f"{source}: tenants.{tenant}.models.{model_id}.replicas: expected http:// URLs")
            models.append(ref_model)
            replicas[ref_model.key] = tuple(Replica(u.rstrip("/"), u.rstrip("/"), urlsplit(u).hostname or "")
                                            for u in urls)
    table, problems = build_key_table(refs, secrets)
    if problems:
        raise StaticConfigError(f"{source}: " + "; ".join(problems))
    return Snapshot(keys=table, catalog=build_catalog(models), replicas=replicas)


class StaticSource:
    def __init__(self, path: str) -> None:
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise StaticConfigError(f"{path}: cannot read ({exc.__class__.__name__}: {exc})") from None
        self.snapshot = static_snapshot(_mapping(config, path), path)
        self.synced = True

    async def run(self) -> None:
        return None

    async def close(self) -> None:
        return None
