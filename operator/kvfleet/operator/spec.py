"""Typed views of the ModelDeployment and Tenant specs, with the CRD's defaults applied.

The apiserver already applies the schema defaults and rejects bad values; parsing them again
here keeps the pure builders usable on plain dicts (unit tests, `helm template` checks) and
turns anything still wrong into a SpecError naming the field.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .errors import SpecError

ENGINE_KINDS = ("kvfleet", "vllm")
API_KEY_ENTRY = "api-key"  # spec.apiKeySecretRef.key when unset: the Secret entry the engines read
# Engine flags the operator sets itself, and what to use instead: given again in engine.extraArgs they would
# override its value where the rest of kvfleet still trusts it (probes, Service, autoscaler and gateway on the
# serving port; the gateway's routing name and replica capacity; the GPUs Kueue admitted; the engine's keys).
# The CRD refuses the same list (crds/: spec.engine.extraArgs).
OWNED_FLAGS: dict[str, str] = {
    "--host": "kvfleet listens on every interface of the pod",
    "--port": "kvfleet serves on port 8000",
    "--metrics-port": "the autoscaler and the gateway read /metrics on the serving port",
    "--served-model-name": "use spec.model.servedName",
    "--tensor-parallel-size": "use spec.engine.tensorParallelSize",
    "-tp": "use spec.engine.tensorParallelSize",
    "--gpu-memory-utilization": "use spec.engine.gpuMemoryUtilization",
    "--max-model-len": "use spec.engine.maxModelLen",
    "--max-num-seqs": "use spec.engine.maxNumSeqs",
    "--api-keys-file": "use spec.apiKeySecretRef",
    "--api-key": "use spec.apiKeySecretRef",
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*(/[-A-Za-z0-9_.]+)?$")  # the CRD's rule for hub ids


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hub", "pvc" or "file"
    uri: str
    claim: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_depth: int = 4
    scale_down_delay_seconds: int = 300


@dataclass(frozen=True)
class ModelDeploymentSpec:
    source: ModelSource
    served_name: str
    engine_kind: str = "kvfleet"
    image: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    gpu_flavor: str | None = None
    cpu: str = "4"
    memory: str = "32Gi"
    shm_size: str = "8Gi"
    replicas: int = 1
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    queue_name: str | None = None
    priority_class_name: str | None = None
    api_key_secret: str | None = None
    api_key_secret_key: str = API_KEY_ENTRY


def parse_model_source(uri: str) -> ModelSource:
    """`org/name` (hub id), `pvc://claim/path/in/claim` or `file:///absolute/path` on a node cache."""
    if not uri:
        raise SpecError("spec.model.source", "must not be empty")
    if uri.startswith("pvc://"):
        claim, _, path = uri[len("pvc://"):].partition("/")
        if not _DNS_LABEL.match(claim):
            raise SpecError("spec.model.source", f"pvc claim name {claim!r} is not a DNS label")
        return ModelSource("pvc", uri, claim=claim, path=path.strip("/"))
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        if not path.startswith("/"):
            raise SpecError("spec.model.source", "file:// sources need an absolute path (file:///...)")
        return ModelSource("file", uri, path=path)
    if "://" in uri:
        raise SpecError("spec.model.source", f"unknown scheme in {uri!r} (hub id, pvc:// or file://)")
    if not _HUB_ID.match(uri):
        raise SpecError("spec.model.source", f"{uri!r} is not a hub id like org/name")
    return ModelSource("hub", uri)


def check_node_path(source: ModelSource, roots: Sequence[str], pod_security: str = "") -> None:
    """A `file://` source must lie under one of the node cache `roots` (the operator's configuration):
    it becomes a hostPath volume, and a tenant may not mount the node's own files. Nor may it when tenant
    namespaces enforce a Pod Security Standard (`pod_security`) that forbids hostPath volumes: the pod would
    never be admitted."""
    if source.kind != "file" or source.path is None:
        return
    path = posixpath.normpath(source.path)
    if not any(path == r or path.startswith(r.rstrip("/") + "/") for r in map(posixpath.normpath, roots)):
        allowed = ", ".join(roots) or "none: file:// sources are off"
        raise SpecError("spec.model.source", f"{path} is not under a node cache root ({allowed})",
                        reason="HostPathNotAllowed")
    if pod_security not in ("", "privileged"):
        raise SpecError("spec.model.source", f"file:// sources mount the node's {path} (a hostPath volume), which "
                        f"the {pod_security} Pod Security Standard of tenant namespaces forbids: serve the model from "
                        "a PersistentVolumeClaim (pvc://), or have tenant namespaces enforce privileged (chart "
                        "value podSecurity.tenantEnforce)", reason="HostPathNotAllowed")


def _int(value: Any, field_name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field_name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(field_name, f"must be >= {minimum}, got {value}")
    return value


def _quantity(value: Any, field_name: str, positive: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or str(value) == "":
        raise SpecError(field_name, f"must be a quantity like '4' or '32Gi', got {value!r}")
    text = str(value).strip()
    # The CRD's rules say the same; a plain dict (unit tests, `helm template`) must not slip through.
    if text.startswith("-") or (positive and text.rstrip("mKMGTPEi").strip("0.") == ""):
        raise SpecError(field_name, f"must be a {'positive' if positive else 'non-negative'} quantity, got {value!r}")
    return text


@dataclass(frozen=True)
class EngineKeySecret:
    """`spec.apiKeySecretRef`: the Secret (in the ModelDeployment's namespace) and the entry the engines read."""

    name: str
    key: str = API_KEY_ENTRY


def engine_key_secret(spec: Mapping[str, Any]) -> EngineKeySecret | None:
    """The engines' own key Secret, or None when they take no key (shared with the gateway)."""
    ref = spec.get("apiKeySecretRef") or {}
    if not isinstance(ref, Mapping) or not ref.get("name"):
        return None
    return EngineKeySecret(str(ref["name"]), str(ref.get("key") or API_KEY_ENTRY))


def served_name(model: Mapping[str, Any]) -> str:
    """The `model` clients send: `spec.model.servedName`, else the source's base name (shared with the gateway)."""
    return str(model.get("servedName") or str(model.get("source", "")).rstrip("/").rsplit("/", 1)[-1])


def owned_flag(args: Sequence[str]) -> str | None:
    """The first of `args` that sets a flag of OWNED_FLAGS (`--port 1`, `--port=1`), or None."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS:
            return name
    return None


def parse_model_deployment(spec: Mapping[str, Any]) -> ModelDeploymentSpec:
    """Parse `ModelDeployment.spec` (a plain dict) into a typed spec; raises SpecError."""
    model = spec.get("model") or {}
    source = parse_model_source(str(model.get("source", "")))
    engine = spec.get("engine") or {}
    resources = spec.get("resources") or {}
    auto = spec.get("autoscaling") or {}
    kind = engine.get("kind", "kvfleet")
    if kind not in ENGINE_KINDS:
        raise SpecError("spec.engine.kind", f"must be one of {ENGINE_KINDS}, got {kind!r}")
    gmu = engine.get("gpuMemoryUtilization", 0.9)
    if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1:
        raise SpecError("spec.engine.gpuMemoryUtilization", f"must be in (0, 1], got {gmu!r}")
    autoscaling = Autoscaling(
        enabled=bool(auto.get("enabled", False)),
        min_replicas=_int(auto.get("minReplicas", 1), "spec.autoscaling.minReplicas"),
        max_replicas=_int(auto.get("maxReplicas", max(1, auto.get("minReplicas", 1))),
                          "spec.autoscaling.maxReplicas", 1),
        target_queue_depth=_int(auto.get("targetQueueDepth", 4), "spec.autoscaling.targetQueueDepth", 1),
        scale_down_delay_seconds=_int(auto.get("scaleDownDelaySeconds", 300),
                                      "spec.autoscaling.scaleDownDelaySeconds"),
    )
    if autoscaling.min_replicas > autoscaling.max_replicas:
        raise SpecError("spec.autoscaling.minReplicas", "must be <= spec.autoscaling.maxReplicas")
    flavor = resources.get("gpuFlavor")
    if flavor is not None and not _DNS_LABEL.match(str(flavor)):
        raise SpecError("spec.resources.gpuFlavor", f"{flavor!r} is not a valid ResourceFlavor name")
    extra_args = tuple(str(a) for a in engine.get("extraArgs") or ())
    flag = owned_flag(extra_args)
    if flag is not None:
        raise SpecError("spec.engine.extraArgs", f"{flag} is set by kvfleet ({OWNED_FLAGS[flag]})")
    key_ref = engine_key_secret(spec)
    served = served_name(model)
    max_len = engine.get("maxModelLen")
    max_seqs = engine.get("maxNumSeqs")
    return ModelDeploymentSpec(
        source=source,
        served_name=str(served),
        engine_kind=kind,
        image=engine.get("image") or None,
        tensor_parallel_size=_int(engine.get("tensorParallelSize", 1), "spec.engine.tensorParallelSize", 1),
        max_model_len=None if max_len is None else _int(max_len, "spec.engine.maxModelLen", 1),
        gpu_memory_utilization=float(gmu),
        max_num_seqs=None if max_seqs is None else _int(max_seqs, "spec.engine.maxNumSeqs", 1),
        extra_args=extra_args,
        env=tuple(dict(e) for e in engine.get("env") or ()),
        gpu_flavor=flavor,
        cpu=_quantity(resources.get("cpu", "4"), "spec.resources.cpu", positive=True),
        memory=_quantity(resources.get("memory", "32Gi"), "spec.resources.memory", positive=True),
        shm_size=_quantity(resources.get("shmSize", "8Gi"), "spec.resources.shmSize", positive=True),
        replicas=_int(spec.get("replicas", 1), "spec.replicas"),
        autoscaling=autoscaling,
        queue_name=spec.get("queueName") or None,
        priority_class_name=spec.get("priorityClassName") or None,
        api_key_secret=key_ref.name if key_ref else None,
        api_key_secret_key=key_ref.key if key_ref else API_KEY_ENTRY,
    )


@dataclass(frozen=True)
class FlavorQuota:
    flavor: str
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None
    cpu: str = "1000"
    memory: str = "10Ti"


@dataclass(frozen=True)
class TenantSpec:
    namespaces: tuple[str, ...]
    quotas: tuple[FlavorQuota, ...]
    group: str | None = None
    cohort: str | None = None
    fair_sharing_weight: str = "1"
    reclaim_within_cohort: str = "Never"
    within_cluster_queue: str = "Never"


def parse_tenant(spec: Mapping[str, Any]) -> TenantSpec:
    """Parse `Tenant.spec` into a typed spec; raises SpecError naming the field."""
    namespaces = tuple(spec.get("namespaces") or ())
    if not namespaces:
        raise SpecError("spec.namespaces", "needs at least one namespace")
    for ns in namespaces:
        if not _DNS_LABEL.match(ns):
            raise SpecError("spec.namespaces", f"{ns!r} is not a valid namespace name")
    cohort = spec.get("cohort") or None
    quotas = []
    seen: set[str] = set()
    for i, q in enumerate(spec.get("quotas") or ()):
        where = f"spec.quotas[{i}]"
        flavor = q.get("flavor", "")
        if not _DNS_LABEL.match(flavor):
            raise SpecError(f"{where}.flavor", f"{flavor!r} is not a valid ResourceFlavor name")
        if flavor in seen:
            raise SpecError(f"{where}.flavor", f"flavor {flavor!r} listed twice")
        seen.add(flavor)
        nominal = _int(q.get("nominal"), f"{where}.nominal")
        borrow = q.get("borrowingLimit")
        lend = q.get("lendingLimit")
        if borrow is not None:
            _int(borrow, f"{where}.borrowingLimit")
            if cohort is None:
                raise SpecError(f"{where}.borrowingLimit", "needs spec.cohort (borrowing is within a cohort)")
        if lend is not None and _int(lend, f"{where}.lendingLimit") > nominal:
            raise SpecError(f"{where}.lendingLimit", "must be <= nominal")
        quotas.append(FlavorQuota(flavor, nominal, borrow, lend,
                                  _quantity(q.get("cpu", "1000"), f"{where}.cpu"),
                                  _quantity(q.get("memory", "10Ti"), f"{where}.memory")))
    if not quotas:
        raise SpecError("spec.quotas", "needs at least one flavor quota")
    preemption = spec.get("preemption") or {}
    return TenantSpec(
        namespaces=namespaces,
        quotas=tuple(quotas),
        group=spec.get("group") or None,
        cohort=cohort,
        fair_sharing_weight=_quantity(spec.get("fairSharingWeight", "1"), "spec.fairSharingWeight"),
        reclaim_within_cohort=preemption.get("reclaimWithinCohort", "Never"),
        within_cluster_queue=preemption.get("withinClusterQueue", "Never"),
    )


def tenant_key_secrets(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Names of the Secrets holding the tenant's gateway API keys (`spec.gateway.apiKeySecrets[].name`)."""
    refs = (spec.get("gateway") or {}).get("apiKeySecrets") or ()
    return tuple(str(r["name"]) for r in refs if isinstance(r, Mapping) and r.get("name"))
