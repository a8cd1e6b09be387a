"""Bringing the local cluster up, down, and reporting on it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml

from . import components as comps
from . import kueue_setup, manifests, pki, procs
from .enginekubelet import processes as engine_processes
from .layout import LAST_PORT_OFFSET, PORT_BASE_FILE, PORT_NAMES, Layout, block_base
from .sharing import locked

log = logging.getLogger(__name__)

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok", "kueue")


@dataclass(frozen=True)
class ComponentState:
    name: str
    pid: int | None
    healthy: bool


def kubectl(layout: Layout, *args: str, stdin: str | None = None, check: bool = True) -> str:
    """Runs the cluster's kubectl with the admin kubeconfig; returns stdout, raises with stderr on failure."""
    argv = [str(layout.binary("kubectl")), f"--kubeconfig={layout.kubeconfig}", *args]
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)  # noqa: S603
    if check and proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def dump_all(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False)


def states(layout: Layout) -> list[ComponentState]:
    """Whether each component runs (our pid) and answers its health probe."""
    result = []
    for name, component in comps.all_components(layout).items():
        pid = procs.running_pid(layout.run, name)
        result.append(ComponentState(name, pid, pid is not None and component.probe.ok()))
    return result


def is_up(layout: Layout) -> bool:
    return layout.kubeconfig.exists() and all(s.healthy for s in states(layout))


def missing_binaries(layout: Layout) -> list[str]:
    return [b for b in BINARIES if not layout.binary(b).exists()]


def busy_ports(layout: Layout) -> list[str]:
    """The cluster's ports that something else already listens on."""
    busy = []
    for name in PORT_NAMES:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", layout.port(name)))
            except OSError:
                busy.append(f"{name}={layout.port(name)}")
    return busy


def _write_kubeconfigs(layout: Layout) -> None:
    ca = (layout.pki / "ca.crt").read_bytes()
    targets = {
        pki.ADMIN: layout.kubeconfig,
        pki.CONTROLLER_MANAGER: layout.run / "controller-manager.kubeconfig",
        pki.SCHEDULER: layout.run / "scheduler.kubeconfig",
    }
    for identity, path in targets.items():
        cert = (layout.pki / f"{identity.stem}.crt").read_bytes()
        key = (layout.pki / f"{identity.stem}.key").read_bytes()
        path.write_text(yaml.safe_dump(manifests.kubeconfig(layout.apiserver_url, ca, identity.user, cert, key)))
        path.chmod(0o600)


def _write_component_configs(layout: Layout) -> None:
    stage_dir = layout.binary("kwok-stage")
    stages = [yaml.safe_load((stage_dir / f).read_text()) for f in manifests.KWOK_STAGE_FILES]
    (layout.run / "kwok-stages.yaml").write_text(dump_all(manifests.kwok_stages(stages)))
    kueue_config = manifests.kueue_configuration(
        layout.port("kueue_health"), layout.port("kueue_metrics"), layout.port("kueue_webhook"),
        str(layout.run / "kueue-certs"),
    )  # fmt: skip
    (layout.run / "kueue-config.yaml").write_text(yaml.safe_dump(kueue_config, sort_keys=False))


def _register_nodes(layout: Layout, node_spec: str) -> list[str]:
    nodes = manifests.gpu_nodes(node_spec, layout.node_ip)
    kubectl(layout, "apply", "--server-side", "--field-manager=kvfleet-cluster", "-f", "-", stdin=dump_all(nodes))
    for node in nodes:
        # Status is a subresource: set capacity explicitly, whether the node was just made or already there.
        patch = json.dumps({"status": node["status"]})
        kubectl(layout, "patch", "node", node["metadata"]["name"], "--subresource=status", "--type=merge", "-p", patch)
    return [n["metadata"]["name"] for n in nodes]


def up(layout: Layout, node_spec: str = manifests.DEFAULT_NODES, timeout: float = 240.0,
       engine_model: str | None = None) -> bool:
    """Brings the cluster up, or leaves a healthy one as it is. True when it started something.

    `engine_model` is the local model of engine pods that choose none (default: $KVFLEET_CLUSTER_ENGINE_MODEL,
    else the embedded SmolLM2); a running engine kubelet keeps its own."""
    manifests.parse_node_spec(node_spec)  # fail on a bad spec before starting anything
    model = engine_model or os.environ.get(comps.ENGINE_MODEL_ENV) or comps.DEFAULT_ENGINE_MODEL
    with locked(layout):
        return _up(layout, node_spec, timeout, model)


def _free_layout(layout: Layout) -> Layout:
    """The layout itself when its ports are free, else the next free block of 100 ports, remembered in
    .cluster/port-base (two checkouts whose paths hash to one block, or a port taken by something else)."""
    busy = busy_ports(layout)
    if not busy:
        return layout
    if os.environ.get("KVFLEET_CLUSTER_PORT_BASE"):
        raise RuntimeError(f"ports already in use: {', '.join(busy)} (KVFLEET_CLUSTER_PORT_BASE is set)")
    first = (layout.base - 20000) // 100
    for step in range(1, 90):
        candidate = layout.with_base(block_base(first + step))
        if not busy_ports(candidate):
            log.info("ports %d-%d are taken (%s); using %d-%d", layout.base + 1, layout.base + LAST_PORT_OFFSET,
                     ", ".join(busy), candidate.base + 1, candidate.base + LAST_PORT_OFFSET)  # fmt: skip
            (layout.root / PORT_BASE_FILE).write_text(f"{candidate.base}\n")
            return candidate
    raise RuntimeError(f"no free block of ports in 20000-28999 (first tried: {', '.join(busy)})")


def _up(layout: Layout, node_spec: str, timeout: float, engine_model: str) -> bool:
    missing = missing_binaries(layout)
    if missing:
        raise RuntimeError(f"missing binaries in {layout.bin}: {', '.join(missing)}; run `make cluster-build`")
    if is_up(layout):
        log.info("cluster already up")
        return False
    unhealthy = [s.name for s in states(layout) if not s.healthy]
    stages = layout.run / "kwok-stages.yaml"
    if layout.kubeconfig.exists() and unhealthy == ["engine-kubelet"] and stages.exists() \
            and manifests.ENGINE_POD_STAGE in stages.read_text():
        # Only the engine kubelet is down (it crashed or was killed): it keeps no state, so restart just it.
        log.info("the engine kubelet is down; restarting it")
        _start_engine_kubelet(layout, engine_model, timeout)
        return True
    # Something is missing or broken: start again from a clean slate (a throw-away test cluster).
    _down(layout)
    layout = _free_layout(layout)
    try:
        _start_everything(layout, node_spec, timeout, engine_model)
    except BaseException:
        # Leave nothing half-started behind (CI runs on a shared machine); the logs stay for the post-mortem.
        log.error("cluster up failed; stopping what was started (logs in %s)", layout.logs)
        _down(layout)
        raise
    return True


def _start_engine_kubelet(layout: Layout, engine_model: str, timeout: float) -> None:
    procs.stop(layout.run, "engine-kubelet")
    kubectl(layout, "apply", "--server-side", "--field-manager=kvfleet-cluster", "-f", "-",
            stdin=dump_all(manifests.engine_kubelet_rbac()))  # fmt: skip
    procs.start_and_wait(comps.engine_kubelet(layout, engine_model), layout.run, layout.logs, timeout)


def _start_everything(layout: Layout, node_spec: str, timeout: float, engine_model: str) -> None:
    started = time.monotonic()
    for d in (layout.run, layout.logs):
        d.mkdir(parents=True, exist_ok=True)
    pki.ensure_pki(layout.pki)
    _write_kubeconfigs(layout)
    _write_component_configs(layout)
    every = comps.all_components(layout)
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        procs.start_and_wait(every[name], layout.run, layout.logs, timeout)
    kueue_setup.install_api(layout, kubectl)
    names = _register_nodes(layout, node_spec)
    procs.start_and_wait(every["kwok"], layout.run, layout.logs, timeout)
    kubectl(layout, "wait", "--for=condition=Ready", f"--timeout={int(timeout)}s", *[f"node/{n}" for n in names])
    procs.start_and_wait(every["kueue"], layout.run, layout.logs, timeout)
    kueue_setup.check_kept_our_certificate(layout, kubectl)
    _start_engine_kubelet(layout, engine_model, timeout)
    log.info("cluster up in %.0f s", time.monotonic() - started)


@dataclass(frozen=True)
class Restart:
    """What one restart took: stopping (SIGTERM until gone), and starting until the health probe answered."""

    name: str
    old_pid: int | None
    new_pid: int
    stop_s: float
    start_s: float


# What a component's restart waits for besides its own probe: the apiserver's readiness needs etcd, so after
# etcd comes back the cluster is usable only once the apiserver is ready again.
_RESTART_ALSO_WAITS = {"etcd": ("kube-apiserver",)}


def restart(layout: Layout, name: str, timeout: float = 180.0, down_for: float = 0.0) -> Restart:
    """Stops one component and starts it again with the same command line and data (etcd keeps its data dir),
    then waits until it, and what depends on it to answer (the apiserver after etcd), is healthy again.

    Holds the cluster lock, so a concurrent `up` (another test session) never mistakes the gap for a broken
    cluster and starts over. `down_for` keeps it stopped that many seconds (an outage, not just a blip)."""
    every = comps.all_components(layout)
    if name not in every:
        raise ValueError(f"unknown component {name!r}; one of {', '.join(every)}")
    with locked(layout):
        old = procs.running_pid(layout.run, name)
        if old is None:
            raise RuntimeError(f"{name} is not running")
        began = time.monotonic()
        procs.stop(layout.run, name)
        stopped = time.monotonic()
        if down_for > 0:
            time.sleep(down_for)
        started = time.monotonic()
        procs.start_and_wait(every[name], layout.run, layout.logs, timeout)
        for other in _RESTART_ALSO_WAITS.get(name, ()):
            procs.wait_ready(every[other], layout.run, layout.logs, timeout)
        new = procs.running_pid(layout.run, name)
        assert new is not None
        restarted = Restart(name, old, new, round(stopped - began, 2), round(time.monotonic() - started, 2))
    log.info("restarted %s: pid %s -> %d, stop %.1f s, start %.1f s", name, old, new, restarted.stop_s,
             restarted.start_s)
    return restarted


def down(layout: Layout) -> list[str]:
    """Stops every component and removes the cluster's state (binaries and logs stay). Safe to run twice."""
    with locked(layout):
        return _down(layout)


def _down(layout: Layout) -> list[str]:
    stopped = procs.stop_all(layout.run, tuple(reversed(comps.ORDER)))
    # The engine kubelet stops its engines; any it could not (it was killed) are stopped from their records.
    left = engine_processes.kill_recorded(layout.engine_records)
    if left:
        log.info("stopped %d engine(s) left running: %s", len(left), ", ".join(f"{r.namespace}/{r.pod}" for r in left))
    for path in (layout.etcd_data, layout.run, layout.pki):
        shutil.rmtree(path, ignore_errors=True)
    layout.kubeconfig.unlink(missing_ok=True)
    return stopped


def describe(layout: Layout) -> str:
    """A human summary: each component, its pid and health, and the nodes when the apiserver answers."""
    lines = [f"cluster of {layout.root} (ports {layout.base + 1}-{layout.base + LAST_PORT_OFFSET}, "
             f"pods {layout.pod_cidr})"]
    component_states = states(layout)
    for s in component_states:
        status = "healthy" if s.healthy else ("running, not ready" if s.pid else "stopped")
        lines.append(f"  {s.name:<24} {status}{f' (pid {s.pid})' if s.pid else ''}")
    api = next(s for s in component_states if s.name == "kube-apiserver")
    if api.healthy:
        columns = ",".join((
            "NODE:.metadata.name",
            "READY:.status.conditions[?(@.type=='Ready')].status",
            "FLAVOR:.metadata.labels.kvfleet\\.dev/gpu-flavor",
            "PRODUCT:.metadata.labels.nvidia\\.com/gpu\\.product",
            "GPUS:.status.allocatable.nvidia\\.com/gpu",
            "CPU:.status.allocatable.cpu",
            "MEMORY:.status.allocatable.memory",
            "IP:.status.addresses[?(@.type=='InternalIP')].address",
        ))  # fmt: skip
        lines.append(kubectl(layout, "get", "nodes", "-o", f"custom-columns={columns}", check=False).rstrip())
    kubelet = next(s for s in component_states if s.name == "engine-kubelet")
    if kubelet.healthy:
        lines.append(describe_engines(engines(layout)))
    return "\n".join(lines)


def engines(layout: Layout) -> list[dict[str, Any]]:
    """The engine kubelet's engines (GET /engines): one row per engine pod."""
    url = f"http://127.0.0.1:{layout.port('engine_kubelet')}/engines"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(url, timeout=5) as response:
            return list(json.loads(response.read())["engines"])
    except (OSError, ValueError, KeyError):
        return []


def describe_engines(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "engines: none (kvfleet engine pods get one each; see e2e/README.md)"
    lines = [f"{'ENGINE POD':<48} {'ADDRESS':<22} {'PID':>7} {'MODEL':<12} {'STATE':<20} READY RESTARTS"]
    for r in rows:
        state = r["state"] + (f" ({r['reason']})" if r.get("reason") else "") + (" stopping" if r["stopping"] else "")
        lines.append(f"{r['namespace'] + '/' + r['pod']:<48} {str(r['ip']) + ':' + str(r['port']):<22} "
                     f"{r['pid'] or '-':>7} {r['model'] or '-':<12} {state:<20} {str(r['ready']).lower():<5} "
                     f"{r['restarts']}")  # fmt: skip
    return "\n".join(lines)


def usage(layout: Layout) -> str:
    return (
        f"export KUBECONFIG={layout.kubeconfig}\n"
        f"export PATH={layout.bin}:$PATH\n"
        "kubectl get nodes -L kvfleet.dev/gpu-flavor   # kwok GPU nodes: pods run as far as the API shows\n"
        "make cluster-status                           # components, each node's GPUs, CPU, memory and IP, engines\n"
        f"logs: {layout.logs}/    stop: make cluster-down"
    )

