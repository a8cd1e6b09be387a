"""A Kubernetes container, as its pod spec says, run by podman: the image tests run the chart's and the operator's
own container specs (user, read-only root, dropped capabilities, emptyDirs, env), not a hand-written command.

`podman_run_flags` is pure: a pod spec and a container in, podman flags out. What a kubelet would supply from the
API server (field references, secrets, service-account tokens) is passed in explicitly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping


class UnsupportedSpec(ValueError):
    """The container uses something this runner cannot supply (say which, rather than run something else)."""


@dataclass(frozen=True)
class Supplied:
    """What a kubelet would take from the cluster: downward-API values and volumes other than emptyDir; and
    where emptyDirs live (a kubelet's are host directories, empty, mode 0777: `empty_dirs` makes them)."""
    field_values: Mapping[str, str] = field(default_factory=dict)   # fieldPath -> value
    volumes: Mapping[str, str] = field(default_factory=dict)        # volume name -> host path (mounted as asked)
    extra_env: Mapping[str, str] = field(default_factory=dict)      # e.g. KUBERNETES_SERVICE_HOST
    empty_dir_root: str = ""                                        # host directory of the emptyDirs ("": tmpfs)


def empty_dirs(pod: Mapping[str, Any]) -> list[str]:
    """Names of the pod's disk-backed emptyDirs (memory-backed ones are tmpfs mounts)."""
    return [v["name"] for v in pod.get("volumes") or () if "emptyDir" in v
            and (v["emptyDir"] or {}).get("medium") != "Memory"]


def _env_flags(container: Mapping[str, Any], supplied: Supplied) -> list[str]:
    flags = []
    for var in container.get("env") or ():
        if "value" in var:
            value = var["value"]
        elif "fieldRef" in (var.get("valueFrom") or {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in supplied.field_values:
                raise UnsupportedSpec(f"env {var['name']}: no value supplied for fieldRef {path}")
            value = supplied.field_values[path]
        else:
            raise UnsupportedSpec(f"env {var['name']}: valueFrom {sorted(var.get('valueFrom') or {})}")
        flags += ["--env", f"{var['name']}={value}"]
    for name, value in supplied.extra_env.items():
        flags += ["--env", f"{name}={value}"]
    return flags


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def _bytes(quantity: str) -> int:
    """A Kubernetes quantity (8Gi, 512M, 1000) in bytes."""
    for unit, factor in sorted(_UNITS.items(), key=lambda u: -len(u[0])):
        if str(quantity).endswith(unit):
            return int(float(str(quantity)[: -len(unit)]) * factor)
    return int(quantity)


def _volume_flags(pod: Mapping[str, Any], container: Mapping[str, Any], supplied: Supplied) -> list[str]:
    volumes = {v["name"]: v for v in pod.get("volumes") or ()}
    flags = []
    for mount in container.get("volumeMounts") or ():
        volume = volumes[mount["name"]]
        path, read_only = mount["mountPath"], bool(mount.get("readOnly"))
        if "emptyDir" in volume and path == "/dev/shm":  # the runtime mounts /dev/shm itself
            size = (volume["emptyDir"] or {}).get("sizeLimit")
            flags += [f"--shm-size={_bytes(size)}"] if size else []
        elif "emptyDir" in volume and supplied.empty_dir_root and mount["name"] in empty_dirs(pod):
            flags += ["--volume", f"{supplied.empty_dir_root}/{mount['name']}:{path}:rw"]
        elif "emptyDir" in volume:
            # podman keeps the mode and owner of a directory the image already has there: use empty_dir_root then.
            size = (volume["emptyDir"] or {}).get("sizeLimit")
            options = ["rw", "mode=1777", "notmpcopyup"] + ([f"size={_bytes(size)}"] if size else [])
            flags += ["--tmpfs", f"{path}:{','.join(options)}"]
        elif mount["name"] in supplied.volumes:
            flags += ["--volume", f"{supplied.volumes[mount['name']]}:{path}:{'ro' if read_only else 'rw'}"]
        else:
            raise UnsupportedSpec(f"volume {mount['name']}: {sorted(set(volume) - {'name'})} is not supplied")
    return flags


def _security_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    pod_ctx, ctx = pod.get("securityContext") or {}, container.get("securityContext") or {}
    user = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    group = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
    flags = []
    if user is not None:
        flags += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if pod_ctx.get("fsGroup") is not None:
        flags += ["--group-add", str(pod_ctx["fsGroup"])]
    if ctx.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]  # writable: only the emptyDirs, as in the pod
    if ctx.get("privileged"):
        raise UnsupportedSpec("privileged containers are not run here")
    for cap in (ctx.get("capabilities") or {}).get("drop") or ():
        flags += ["--cap-drop", cap]
    if ctx.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp != "RuntimeDefault":  # podman's default profile is the runtime default
        raise UnsupportedSpec(f"seccompProfile {seccomp}")
    return flags


def podman_run_flags(pod: Mapping[str, Any], container: Mapping[str, Any], supplied: Supplied = Supplied()
                     ) -> list[str]:
    """Flags of `podman run` that give `container` (of pod spec `pod`) what its spec says; the image, command and
    args follow them (`command_and_args`)."""
    return [*_security_flags(pod, container), *_volume_flags(pod, container, supplied),
            *_env_flags(container, supplied)]


def command_and_args(container: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(--entrypoint flags, arguments after the image): Kubernetes' command replaces the entrypoint, args the CMD."""
    command = list(container.get("command") or ())
    args = list(container.get("args") or ())
    return (["--entrypoint", json.dumps(command)] if command else []), args
