"""What an engine pod asks for, and the `kvfleet serve` command that serves it on CPU (pure: dicts in, data out).

The operator writes GPU pods (`kvfleet serve MODEL --host 0.0.0.0 --port 8000 --tensor-parallel-size 2 ...`, or the
same flags for `vllm serve`). On the local cluster the same pod is served by `kvfleet serve` on CPU: the model is a
local one (see `models`), the address is the pod's loopback IP, GPU-only flags are dropped, and the flags that still
mean something (served model name, max-model-len, max-num-seqs, API keys, ...) are kept. Every change is reported as
a note, written at the top of the engine's log.
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfleet.engine.server.args import SERVE_FLAGS

ENGINE_LABEL = "app.kubernetes.io/name"
ENGINE_LABEL_VALUE = "kvfleet-engine"
ENGINE_SELECTOR = f"{ENGINE_LABEL}={ENGINE_LABEL_VALUE}"
# Which local model serves a pod: on the pod, else on its namespace, else the engine kubelet's default.
MODEL_ANNOTATION = "kvfleet.dev/local-engine-model"
DEFAULT_PORT = 8000

# Replaced by the engine kubelet (address, device) or meaningless on CPU (GPU sharding and memory).
_REPLACED_FLAGS = ("--host", "--port", "--device", "--tensor-parallel-size", "--gpu-memory-utilization", "--model")
_BOOLEAN_FLAGS = frozenset(f.name for f in SERVE_FLAGS if f.boolean) | frozenset(
    "--no-" + f.name[2:] for f in SERVE_FLAGS if f.boolean
)
_VALUE_FLAGS = frozenset(f.name for f in SERVE_FLAGS if not f.boolean) | {"--model"}
# Environment of the node that an engine may see (a container does not inherit the node's environment).
_NODE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "VIRTUAL_ENV", "KVFLEET_CACHE")
# Frugal on 2 shared cores: one thread per engine for torch and the BLAS libraries; never reach a model hub.
_ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
# Pod environment that names container paths or GPU settings with no meaning here (HOME and the caches point at
# the pod's emptyDirs: the node's HOME stays).
_DROPPED_ENV = frozenset({"HF_HOME", "HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES",
                          "NCCL_CUMEM_ENABLE"})


@dataclass(frozen=True)
class ProbeSpec:
    """A container probe's timing (Kubernetes' defaults where the pod says nothing)."""

    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3
    success_threshold: int = 1
    initial_delay_s: float = 0.0

    @classmethod
    def from_probe(cls, probe: Mapping[str, Any] | None) -> ProbeSpec | None:
        if not probe:
            return None
        return cls(
            period_s=float(probe.get("periodSeconds") or 10),
            timeout_s=float(probe.get("timeoutSeconds") or 1),
            failure_threshold=int(probe.get("failureThreshold") or 3),
            success_threshold=int(probe.get("successThreshold") or 1),
            initial_delay_s=float(probe.get("initialDelaySeconds") or 0),
        )


@dataclass(frozen=True)
class EnvVar:
    """One entry of the container's `env`: a literal value, a field of the pod, or a key of a Secret."""

    name: str
    value: str | None = None
    field_path: str | None = None
    secret: tuple[str, str] | None = None  # (Secret name, key)
    optional: bool = False


@dataclass(frozen=True)
class SecretVolume:
    """A Secret volume the container mounts: its files appear under `mount_path`."""

    volume: str
    secret: str
    mount_path: str
    items: tuple[tuple[str, str], ...] = ()  # (key, relative path); empty: every key, named after it
    optional: bool = False


@dataclass(frozen=True)
class EnginePod:
    """The parts of an engine pod the engine kubelet acts on."""

    namespace: str
    name: str
    uid: str
    node: str | None
    pod_ip: str | None
    phase: str
    deleting: bool
    grace_s: int
    container: str
    image: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    port: int
    env: tuple[EnvVar, ...]
    secret_volumes: tuple[SecretVolume, ...]
    restart_policy: str
    startup: ProbeSpec | None
    readiness: ProbeSpec | None
    liveness: ProbeSpec | None
    model_annotation: str | None
    status: Mapping[str, Any] = field(repr=False, default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def engine_kind(self) -> str:
        """`vllm` for a vLLM pod (served here by kvfleet with the same flags), else `kvfleet`."""
        return "vllm" if self.command[:1] == ("vllm",) else "kvfleet"

    def loopback_ip(self) -> str | None:
        """The pod IP when it is a loopback address (the only kind an engine may bind), else None."""
        if not self.pod_ip:
            return None
        try:
            return self.pod_ip if ipaddress.ip_address(self.pod_ip).is_loopback else None
        except ValueError:
            return None


def is_engine_pod(obj: Mapping[str, Any]) -> bool:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(ENGINE_LABEL) == ENGINE_LABEL_VALUE


def _port(container: Mapping[str, Any]) -> int:
    """The container port named `http` (the operator's), else the first one, else 8000."""
    ports = container.get("ports") or []
    for port in ports:
        if port.get("name") == "http" and port.get("containerPort"):
            return int(port["containerPort"])
    return int(ports[0]["containerPort"]) if ports and ports[0].get("containerPort") else DEFAULT_PORT


def _env(container: Mapping[str, Any]) -> tuple[EnvVar, ...]:
    out = []
    for entry in container.get("env") or []:
        source = entry.get("valueFrom") or {}
        if "fieldRef" in source:
            out.append(EnvVar(entry["name"], field_path=source["fieldRef"].get("fieldPath")))
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            out.append(EnvVar(entry["name"], secret=(ref["name"], ref["key"]), optional=bool(ref.get("optional"))))
        elif source:
            continue  # configMapKeyRef / resourceFieldRef: nothing of ours uses them
        else:
            out.append(EnvVar(entry["name"], value=str(entry.get("value", ""))))
    return tuple(out)


def _secret_volumes(spec: Mapping[str, Any], container: Mapping[str, Any]) -> tuple[SecretVolume, ...]:
    secrets = {v["name"]: v["secret"] for v in spec.get("volumes") or [] if v.get("secret")}
    out = []
    for mount in container.get("volumeMounts") or []:
        source = secrets.get(mount["name"])
        if source is None:
            continue
        items = tuple((i["key"], i["path"]) for i in source.get("items") or [])
        out.append(SecretVolume(mount["name"], source["secretName"], mount["mountPath"], items,
                                bool(source.get("optional"))))  # fmt: skip
    return tuple(out)


def parse_pod(obj: Mapping[str, Any]) -> EnginePod:
    """An engine pod's view; the first container is the engine (the operator makes one)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    container = (spec.get("containers") or [{}])[0]
    return EnginePod(
        namespace=meta.get("namespace", ""),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        node=spec.get("nodeName"),
        pod_ip=status.get("podIP"),
        phase=status.get("phase", "Pending"),
        deleting=bool(meta.get("deletionTimestamp")),
        grace_s=int(meta.get("deletionGracePeriodSeconds") or spec.get("terminationGracePeriodSeconds") or 30),
        container=container.get("name", "engine"),
        image=container.get("image", ""),
        command=tuple(container.get("command") or ()),
        args=tuple(str(a) for a in container.get("args") or ()),
        port=_port(container),
        env=_env(container),
        secret_volumes=_secret_volumes(spec, container),
        restart_policy=spec.get("restartPolicy", "Always"),
        startup=ProbeSpec.from_probe(container.get("startupProbe")),
        readiness=ProbeSpec.from_probe(container.get("readinessProbe")),
        liveness=ProbeSpec.from_probe(container.get("livenessProbe")),
        model_annotation=(meta.get("annotations") or {}).get(MODEL_ANNOTATION),
        status=status,
    )


# --- the command ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    """The model that serves a pod here: the choice it came from, its path, and its longest context."""

    choice: str
    path: str
    max_model_len: int


@dataclass(frozen=True)
class EngineOptions:
    """What the engine kubelet adds to every engine."""

    python: str
    max_num_seqs: int = 4  # when the pod sets none (the engine's own default, 256, is a GPU's)
    max_num_seqs_cap: int = 16
    shutdown_grace_s: float = 10.0  # the engine's drain after SIGTERM, unless the pod sets it


@dataclass(frozen=True)
class EngineCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class ParsedArgs:
    model: str | None
    flags: tuple[tuple[str, str | None], ...]  # (flag, value or None for booleans), in order
    positionals: tuple[str, ...]  # any other bare word (kvfleet serve would refuse it, as it should)


def parse_args(args: Sequence[str]) -> ParsedArgs:
    """Splits `vllm serve`-style arguments into the model, the flags with their values, and stray words."""
    model: str | None = None
    flags: list[tuple[str, str | None]] = []
    positionals: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        if token.startswith("--"):
            name, eq, inline = token.partition("=")
            if eq:
                flags.append((name, inline))
            elif name in _BOOLEAN_FLAGS:
                flags.append((name, None))
            elif name in _VALUE_FLAGS or (i + 1 < len(args) and not args[i + 1].startswith("--")):
                # An unknown flag (vLLM's own) takes the next word when that is not a flag.
                flags.append((name, args[i + 1] if i + 1 < len(args) else ""))
                i += 1
            else:
                flags.append((name, None))
        elif model is None and not flags:
            model = token
        else:
            positionals.append(token)
        i += 1
    return ParsedArgs(model, tuple(flags), tuple(positionals))


def container_to_local(path: str, mounts: Mapping[str, str]) -> str:
    """A container path under a mounted volume -> the same file in the volume's local folder."""
    norm = posixpath.normpath(path)
    for mount_path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
        root = posixpath.normpath(mount_path)
        if norm == root or norm.startswith(root.rstrip("/") + "/"):
            return local + norm[len(root):]
    return path


def engine_command(pod: EnginePod, model: LocalModel, options: EngineOptions, mounts: Mapping[str, str],
                   env: Mapping[str, str]) -> EngineCommand:  # fmt: skip
    """The `kvfleet serve` command line that serves `pod` on CPU with `model`.

    `mounts` maps the pod's volume mount paths to local folders holding their files; `env` is the container's
    resolved environment (see `resolve_env`)."""
    ip = pod.loopback_ip()
    if ip is None:
        raise ValueError(f"pod IP {pod.pod_ip!r} is not a loopback address")
    parsed = parse_args(pod.args)
    notes: list[str] = []
    kept: list[str] = []
    seen: set[str] = set()
    for flag, value in parsed.flags:
        seen.add(flag)
        if flag in _REPLACED_FLAGS:
            notes.append(f"{flag} {value or ''}".strip() + " replaced (loopback pod IP, CPU, one process)")
            continue
        if flag == "--max-model-len" and value is not None and value.isdigit() and int(value) > model.max_model_len:
            notes.append(f"--max-model-len {value} capped to {model.max_model_len} (the local model's longest)")
            value = str(model.max_model_len)
        if flag == "--max-num-seqs" and value is not None and value.isdigit() \
                and int(value) > options.max_num_seqs_cap:
            notes.append(f"--max-num-seqs {value} capped to {options.max_num_seqs_cap} (CPU)")
            value = str(options.max_num_seqs_cap)
        if value is not None:
            local = container_to_local(value, mounts)
            if local != value:
                notes.append(f"{flag} {value} -> {local} (the mounted volume's local copy)")
            kept += [f"{flag}={local}"] if local.startswith("-") else [flag, local]
        else:
            kept.append(flag)
    defaults: list[str] = []
    if "--served-model-name" not in seen and parsed.model:
        defaults += ["--served-model-name", parsed.model]  # clients ask for the model the pod names
    if "--max-num-seqs" not in seen:
        defaults += ["--max-num-seqs", str(options.max_num_seqs)]
    if "--shutdown-grace-period" not in seen:
        defaults += ["--shutdown-grace-period", f"{options.shutdown_grace_s:g}"]
    if parsed.model:
        notes.append(f"model {parsed.model} served by the local model {model.choice} ({model.path})")
    if pod.engine_kind == "vllm":
        notes.append("a vLLM pod: kvfleet serve takes the same flags")
    argv = (options.python, "-m", "kvfleet.engine.cli", "serve", model.path, *defaults, *kept, *parsed.positionals,
            "--host", ip, "--port", str(pod.port), "--device", "cpu", "--tensor-parallel-size", "1")  # fmt: skip
    return EngineCommand(argv, dict(env), tuple(notes))


# --- the environment --------------------------------------------------------------------------------------

SecretLookup = Callable[[str, str], "str | None"]


class MissingSecret(LookupError):
    """A Secret (or key) the container needs does not exist: the container cannot be created yet."""


def field_value(pod: EnginePod, path: str | None) -> str:
    """The downward API fields an engine pod uses."""
    values = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": pod.uid,
              "spec.nodeName": pod.node or "", "status.podIP": pod.pod_ip or ""}  # fmt: skip
    return values.get(path or "", "")


def resolve_env(pod: EnginePod, node_env: Mapping[str, str], secret: SecretLookup) -> dict[str, str]:
    """The engine's environment: a few of the node's variables, the engine defaults, then the pod's own
    (with its fields and Secret keys resolved). Raises MissingSecret for a Secret key that is not there."""
    env = {k: node_env[k] for k in _NODE_ENV if k in node_env}
    env.update(_ENGINE_ENV)
    for var in pod.env:
        if var.name in _DROPPED_ENV:
            continue
        if var.secret is not None:
            value = secret(*var.secret)
            if value is None:
                if var.optional:
                    continue
                raise MissingSecret(f"secret {var.secret[0]!r} key {var.secret[1]!r} (env {var.name})")
        elif var.field_path is not None:
            value = field_value(pod, var.field_path)
        else:
            value = var.value or ""
        env[var.name] = value
    if "VLLM_API_KEY" in env and "KVFLEET_API_KEY" not in env:
        env["KVFLEET_API_KEY"] = env["VLLM_API_KEY"]  # vLLM's one key, under kvfleet's name
    return env


def secret_files(volume: SecretVolume, data: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files a Secret volume shows (relative path -> content), as the kubelet lays them out."""
    if not volume.items:
        return dict(data)
    return {path: data[key] for key, path in volume.items if key in data}
