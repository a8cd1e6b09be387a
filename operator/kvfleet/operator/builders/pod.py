"""The engine pod template: image, `kvfleet serve` / `vllm serve` flags, probes, volumes, security."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..config import OperatorConfig
from ..constants import ENGINE_PORT, GPU_RESOURCE, GPU_TOLERATION
from ..spec import ModelDeploymentSpec, check_node_path
from .grace import GRACE_FLAG, engine_grace_seconds, termination_grace_seconds
from .meta import mdep_labels

API_KEYS_DIR = "/etc/kvfleet/api-keys"
# The root file system is read-only: what the engine writes goes to emptyDirs. HOME holds every cache (Triton's
# kernels, torch's, the CUDA driver's, vLLM's); /tmp what Python and Triton put in temporary files.
ENGINE_HOME = "/home/kvfleet"


def engine_image(spec: ModelDeploymentSpec, config: OperatorConfig) -> str:
    if spec.image:
        return spec.image
    return config.vllm_image if spec.engine_kind == "vllm" else config.kvfleet_image


def model_argument(spec: ModelDeploymentSpec, config: OperatorConfig) -> str:
    """What the engine is told to load: a hub id as is, or the path where the volume is mounted."""
    src = spec.source
    if src.kind == "pvc":
        return f"{config.model_cache_path}/{src.claim}" + (f"/{src.path}" if src.path else "")
    if src.kind == "file":
        return src.path or "/"
    return src.uri


def build_engine_args(spec: ModelDeploymentSpec, config: OperatorConfig) -> tuple[list[str], list[str]]:
    """(command, args) for the engine container; both engines take the same `vllm serve` flags."""
    command = ["kvfleet", "serve"] if spec.engine_kind == "kvfleet" else ["vllm", "serve"]
    args = [
        model_argument(spec, config),
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--served-model-name", spec.served_name,
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
    ]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.api_key_secret and spec.engine_kind == "kvfleet":
        # kvfleet maps keys to tenants from a file; vllm takes one key from VLLM_API_KEY (see env).
        args += ["--api-keys-file", f"{API_KEYS_DIR}/{spec.api_key_secret_key}"]
    if spec.engine_kind == "kvfleet":   # explicit: the pod's terminationGracePeriodSeconds is derived from it
        args += [GRACE_FLAG, f"{engine_grace_seconds(spec.extra_args, spec.env):g}"]
    return command, args + list(spec.extra_args)


def _env(mdep_name: str, spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KVFLEET_MODEL_DEPLOYMENT", "value": mdep_name},
        {"name": "KVFLEET_SERVED_MODEL_NAME", "value": spec.served_name},
        {"name": "KVFLEET_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KVFLEET_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HF_HOME", "value": "/models/hf-cache"},
        # Whatever the image says (vLLM's runs as root with HOME=/root): caches land on the writable emptyDir.
        {"name": "HOME", "value": ENGINE_HOME},
        {"name": "XDG_CACHE_HOME", "value": f"{ENGINE_HOME}/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": f"{ENGINE_HOME}/.cache/triton"},
    ]
    if spec.api_key_secret and spec.engine_kind == "vllm":
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": spec.api_key_secret, "key": spec.api_key_secret_key}}})
    return env + [dict(e) for e in spec.env]


def _volumes(spec: ModelDeploymentSpec, config: OperatorConfig) -> tuple[list[dict], list[dict]]:
    volumes: list[dict[str, Any]] = [
        # NCCL and the engine's workers share tensors through /dev/shm; the default 64Mi is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        {"name": "hf-cache", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "hf-cache", "mountPath": "/models/hf-cache"},
        {"name": "home", "mountPath": ENGINE_HOME},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    src = spec.source
    if src.kind == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": f"{config.model_cache_path}/{src.claim}", "readOnly": True})
    elif src.kind == "file":
        check_node_path(src, config.node_cache_roots, config.tenant_pod_security)  # never one PodSecurity refuses
        volumes.append({"name": "model", "hostPath": {"path": src.path, "type": ""}})
        mounts.append({"name": "model", "mountPath": src.path, "readOnly": True})
    if spec.api_key_secret:
        volumes.append({"name": "api-keys", "secret": {"secretName": spec.api_key_secret}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def _probes(config: OperatorConfig) -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    period = 10
    return {
        # Loading a large model takes minutes: the startup probe holds the other two off until then.
        "startupProbe": {**health, "periodSeconds": period, "timeoutSeconds": 5,
                         "failureThreshold": max(1, config.startup_timeout_seconds // period)},
        "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 6},
    }


def container_resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    """Requests Kueue counts and the scheduler places; GPU limit = requests (extended resource)."""
    gpus = str(spec.tensor_parallel_size)
    return {
        "requests": {"cpu": spec.cpu, "memory": spec.memory, GPU_RESOURCE: gpus},
        "limits": {"memory": spec.memory, GPU_RESOURCE: gpus},
    }


def build_pod_template(
    mdep_name: str,
    spec: ModelDeploymentSpec,
    config: OperatorConfig,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Any]] = (),
    extra_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A PodTemplateSpec for one engine replica, placed by the flavor's node selector/tolerations."""
    command, args = build_engine_args(spec, config)
    volumes, mounts = _volumes(spec, config)
    labels = {**mdep_labels(mdep_name, "engine"), **(extra_labels or {})}
    container = {
        "name": "engine",
        "image": engine_image(spec, config),
        "imagePullPolicy": config.image_pull_policy,
        "command": command,
        "args": args,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _env(mdep_name, spec),
        "resources": container_resources(spec),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        **_probes(config),
    }
    tols = [dict(GPU_TOLERATION)] + [dict(t) for t in tolerations if dict(t) != GPU_TOLERATION]
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "tolerations": tols,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(engine_grace_seconds(spec.extra_args, spec.env)),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": config.run_as_user,
            "runAsGroup": config.run_as_user,
            "fsGroup": config.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    return {
        "metadata": {
            "labels": labels,
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }
