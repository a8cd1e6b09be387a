"""The engine kubelet's loop: pod events in; engines started, probed, restarted and stopped; pod status out.

Everything that changes an engine happens on the thread that runs `Supervisor.run` (the process's main thread:
engines are started from it, and launch.py ties each engine's life to that thread). Other threads only put items
on its queue: the pod watch (`Listed`, `Watched`), the probers (`ProbeReport`) and model preparation
(`ModelPrepared`).
"""

from __future__ import annotations

import base64
import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import models, processes, secret_volumes
from .api import ApiError, ApiServer, Gone
from .pods import (
    ENGINE_SELECTOR,
    MODEL_ANNOTATION,
    EngineOptions,
    EnginePod,
    LocalModel,
    MissingSecret,
    engine_command,  # fmt: skip
    is_engine_pod,
    parse_pod,
    resolve_env,
    secret_files,
)
from .probes import Prober, ProbeReport, ProbeTracker, Verdict
from .status import (
    ContainerState,
    Terminated,
    now_rfc3339,
    phase_after_exit,
    restart_delay,
    restarts_after_exit,
    status_drifted,
    status_patch,  # fmt: skip
    terminated,
)

log = logging.getLogger("engine-kubelet")

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
COMPONENT = "kvfleet-engine-kubelet"
RETRY_S = 5.0  # a container that cannot be created yet (model failed, Secret missing) is tried again after this
# How often a running engine's Secret volumes are compared with their Secrets (a real kubelet: its sync period,
# about a minute, plus its cache's; short here so that tests of a rotation wait seconds, not minutes).
SECRET_SYNC_S = 2.0


@dataclass(frozen=True)
class Listed:
    pods: list[dict[str, Any]]


@dataclass(frozen=True)
class Watched:
    kind: str  # ADDED, MODIFIED, DELETED
    pod: dict[str, Any]


@dataclass(frozen=True)
class ModelPrepared:
    uid: str
    choice: str
    model: LocalModel | None
    error: str | None


@dataclass(frozen=True)
class Settings:
    records: Path  # .cluster/run/engines
    logs: Path  # .cluster/logs/engines
    volumes: Path  # where Secret volumes are written for the engines
    default_model: str
    options: EngineOptions
    max_grace_s: float = 15.0  # the longest an engine may drain after SIGTERM before SIGKILL
    fast_probe_s: float = 1.0


@dataclass
class Engine:
    """One engine pod and the engine process serving it (mutated only on the supervisor's thread)."""

    pod: EnginePod
    container: ContainerState
    restart_count: int = 0
    crashes: int = 0  # ends in a row, for the back-off
    run: int = 0
    phase: str = "Pending"
    proc: subprocess.Popen[bytes] | None = None
    record: processes.EngineRecord | None = None
    prober: Prober | None = None
    started_iso: str = ""
    started_mono: float = 0.0
    model: str = ""
    next_start: float = 0.0
    preparing: bool = False
    last: Terminated | None = None
    kill_deadline: float | None = None  # SIGKILL the group at this time (stopping, or restarting a hung engine)
    killed: bool = False
    stopping: bool = False
    delete_when_stopped: bool = False
    deleted: bool = False
    gone: bool = False  # the pod left the API
    finished: bool = False  # nothing more will run for this pod
    dirty: bool = True
    next_flush: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    secret_digests: dict[str, str] = field(default_factory=dict)  # volume name -> the version written
    next_secret_sync: float = 0.0

    @property
    def log_path_name(self) -> str:
        return f"{self.pod.namespace}.{self.pod.name}.log"


def _secret_data(secret: dict[str, Any] | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in ((secret or {}).get("data") or {}).items()}


def carried_restart_count(pod: EnginePod) -> int:
    """Restarts the pod's status already counts; one more if an earlier engine kubelet ran it (a restart too)."""
    for status in pod.status.get("containerStatuses") or []:
        if status.get("name") == pod.container:
            count = int(status.get("restartCount") or 0)
            state = status.get("state") or {}
            return count + (1 if "running" in state or "terminated" in state else 0)
    return 0


class Supervisor:
    def __init__(self, api: ApiServer, catalog: models.ModelCatalog, settings: Settings) -> None:
        self.api, self.catalog, self.settings = api, catalog, settings
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.engines: dict[str, Engine] = {}
        self.forgotten: dict[str, float] = {}  # uid -> when: pods done with (late events about them are ignored)
        self.fake_nodes: dict[str, bool] = {}
        self.last_tick = time.monotonic()
        self.synced = threading.Event()
        self._snapshot: list[dict[str, Any]] = []
        self._snapshot_lock = threading.Lock()

    # --- the loop ---------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = self.inbox.get(timeout=0.2)
                self.handle(item)
                while True:  # everything already queued, then one tick
                    self.handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            self.tick()
        self.shutdown()

    def handle(self, item: Any) -> None:
        if isinstance(item, Listed):
            self.synced.set()
            uids = set()
            for pod in item.pods:
                uids.add((pod.get("metadata") or {}).get("uid"))
                self.on_pod(pod)
            for uid in [u for u in self.engines if u not in uids]:
                self.on_gone(uid)
        elif isinstance(item, Watched):
            if item.kind == "DELETED":
                self.on_gone((item.pod.get("metadata") or {}).get("uid", ""))
            else:
                self.on_pod(item.pod)
        elif isinstance(item, ProbeReport):
            self.on_probe(item)
        elif isinstance(item, ModelPrepared):
            self.on_model(item)

    def tick(self) -> None:
        now = time.monotonic()
        self.last_tick = now
        for engine in list(self.engines.values()):
            try:
                self.tick_engine(engine, now)
            except (ApiError, httpx.HTTPError, OSError) as err:
                log.warning("pod %s: %s", engine.pod.ref, err)
                engine.next_flush = now + 1.0
                engine.next_start = max(engine.next_start, now + 1.0)
        for uid in [u for u, e in self.engines.items() if (e.gone or e.deleted) and e.proc is None]:
            del self.engines[uid]
            self.forgotten[uid] = now
        for uid in [u for u, t in self.forgotten.items() if now - t > 600]:
            del self.forgotten[uid]
        self._publish()

    def tick_engine(self, engine: Engine, now: float) -> None:
        if engine.proc is not None and engine.proc.poll() is not None:
            self.on_exit(engine, now)
        if engine.proc is not None and engine.kill_deadline is not None and now >= engine.kill_deadline \
                and not engine.killed:
            log.info("pod %s: engine (pid %d) still running after its grace period: SIGKILL", engine.pod.ref,
                     engine.proc.pid)  # fmt: skip
            processes.signal_group(engine.proc.pid, signal.SIGKILL)
            engine.killed = True
        if self.wants_start(engine, now):
            self.start(engine, now)
        if engine.proc is not None and engine.pod.secret_volumes and now >= engine.next_secret_sync:
            engine.next_secret_sync = now + SECRET_SYNC_S
            self.sync_secret_volumes(engine)
        if engine.finished and engine.delete_when_stopped and not engine.deleted and not engine.gone \
                and now >= engine.next_flush:
            # The engine is gone: the pod may go (a kubelet's final delete, grace 0, this pod's uid only).
            if not self.api.delete_pod(engine.pod.namespace, engine.pod.name, engine.pod.uid):
                engine.gone = True
            engine.deleted = True
        if engine.dirty and not engine.gone and not engine.deleted and now >= engine.next_flush:
            updated = self.api.patch_pod_status(engine.pod.namespace, engine.pod.name,
                                                status_patch(engine.pod.status, engine.container, engine.phase,
                                                             now_rfc3339()))  # fmt: skip
            engine.dirty = False
            if updated is None:
                engine.gone = True
            else:
                engine.pod = parse_pod(updated)

    # --- pods -------------------------------------------------------------------------------------------------
    def is_fake_node(self, name: str) -> bool:
        if name not in self.fake_nodes:
            node = self.api.node(name) or {}
            self.fake_nodes[name] = ((node.get("metadata") or {}).get("annotations") or {}).get(
                KWOK_NODE_ANNOTATION) == "fake"
        return self.fake_nodes[name]

    def on_pod(self, obj: dict[str, Any]) -> None:
        if not is_engine_pod(obj):
            return
        pod = parse_pod(obj)
        engine = self.engines.get(pod.uid)
        if engine is None:
            if pod.uid in self.forgotten or not pod.node or pod.phase in ("Succeeded", "Failed"):
                return
            try:
                if not self.is_fake_node(pod.node):
                    return
            except (ApiError, httpx.HTTPError) as err:
                log.warning("node %s: %s", pod.node, err)
                return
            if not pod.pod_ip and not pod.deleting:
                return  # kwok has not given it an address yet
            restarts = carried_restart_count(pod)
            engine = Engine(pod, ContainerState(pod.container, pod.image, restarts), restart_count=restarts)
            self.engines[pod.uid] = engine
            log.info("pod %s: engine pod on %s, IP %s", pod.ref, pod.node, pod.pod_ip)
        else:
            engine.pod = pod
            if engine.proc is not None and not engine.stopping and not pod.deleting \
                    and status_drifted(pod.status, engine.container, engine.phase):
                engine.dirty = True  # someone else wrote the pod's status: write ours back (as a kubelet does)
        if pod.deleting and not engine.stopping:
            self.stop(engine, delete=True)

    def on_gone(self, uid: str) -> None:
        engine = self.engines.get(uid)
        if engine is None:
            return
        engine.gone = True
        if not engine.stopping:
            self.stop(engine, delete=False)

    # --- starting ---------------------------------------------------------------------------------------------
    def wants_start(self, engine: Engine, now: float) -> bool:
        return (engine.proc is None and not engine.stopping and not engine.finished and not engine.preparing
                and now >= engine.next_start)  # fmt: skip

    def waiting(self, engine: Engine, reason: str, message: str) -> None:
        engine.container = ContainerState(engine.pod.container, engine.pod.image, engine.restart_count,
                                          waiting=(reason, message), last=engine.last)  # fmt: skip
        engine.dirty = True

    def model_choice(self, pod: EnginePod) -> str:
        namespace = self.api.namespace(pod.namespace) or {}
        annotations = (namespace.get("metadata") or {}).get("annotations") or {}
        return models.choose(pod.model_annotation, annotations.get(MODEL_ANNOTATION), self.settings.default_model)

    def start(self, engine: Engine, now: float) -> None:
        pod = engine.pod
        if pod.loopback_ip() is None:
            if not engine.finished:
                log.error("pod %s: IP %r is not a loopback address; no engine will run", pod.ref, pod.pod_ip)
                self.waiting(engine, "CreateContainerError", f"pod IP {pod.pod_ip} is not a loopback address")
                engine.finished = True
            return
        choice = self.model_choice(pod)
        try:
            model = self.catalog.known(choice)
            if model is None:
                models.check_choice(choice)
        except models.ModelError as err:
            self.cannot_create(engine, now, str(err))
            return
        if model is None:
            engine.preparing = True
            self.waiting(engine, "ContainerCreating", f"preparing the local model {choice}")
            threading.Thread(target=self.prepare, args=(pod.uid, choice), name=f"model-{choice[:20]}",
                             daemon=True).start()  # fmt: skip
            return
        try:
            mounts = self.write_secret_volumes(engine)
            env = resolve_env(pod, os.environ, self.secret_value(pod.namespace))
            command = engine_command(pod, model, self.settings.options, mounts, env)
        except (MissingSecret, ValueError) as err:
            self.cannot_create(engine, now, str(err))
            return
        log_path = self.settings.logs / engine.log_path_name
        header = [f"pod {pod.ref} uid {pod.uid} run {engine.run + 1}", *command.notes]
        proc = processes.spawn(command.argv, command.env, log_path, header, self.settings.options.python)
        record = processes.EngineRecord(pod.namespace, pod.name, pod.uid, proc.pid, command.argv, str(log_path))
        processes.write_record(self.settings.records, record)
        if engine.run > 0:
            engine.restart_count += 1
        engine.run += 1
        engine.proc, engine.record, engine.model, engine.notes = proc, record, model.choice, command.notes
        engine.started_iso, engine.started_mono = now_rfc3339(), now
        engine.kill_deadline, engine.killed = None, False
        engine.container = ContainerState(pod.container, pod.image, engine.restart_count,
                                          running_since=engine.started_iso, last=engine.last,
                                          container_id=f"kvfleet-local://{proc.pid}")  # fmt: skip
        engine.phase, engine.dirty = "Running", True
        tracker = ProbeTracker(pod.startup, pod.readiness, pod.liveness, now, self.settings.fast_probe_s)
        engine.prober = Prober(pod.uid, engine.run, pod.pod_ip or "", pod.port, tracker, self.inbox.put)
        engine.prober.start()
        log.info("pod %s: started engine pid %d on %s:%d, model %s (log %s)", pod.ref, proc.pid, pod.pod_ip,
                 pod.port, model.choice, log_path)  # fmt: skip
        self.event(engine, "Started", f"Started kvfleet serve (pid {proc.pid}, model {model.choice}) on "
                                      f"{pod.pod_ip}:{pod.port}")  # fmt: skip

    def cannot_create(self, engine: Engine, now: float, message: str) -> None:
        log.warning("pod %s: cannot start its engine: %s", engine.pod.ref, message)
        self.waiting(engine, "CreateContainerError", message)
        engine.next_start = now + RETRY_S

    def prepare(self, uid: str, choice: str) -> None:
        """On a helper thread: prepares a model, then tells the loop."""
        try:
            model = self.catalog.get(choice)
            self.inbox.put(ModelPrepared(uid, choice, model, None))
        except (models.ModelError, OSError, ValueError, subprocess.SubprocessError) as err:
            self.inbox.put(ModelPrepared(uid, choice, None, str(err)))

    def on_model(self, item: ModelPrepared) -> None:
        engine = self.engines.get(item.uid)
        if engine is None:
            return
        engine.preparing = False
        if item.error:
            self.cannot_create(engine, time.monotonic(), item.error)
        else:
            log.info("model %s ready: %s (max_model_len %s)", item.choice, item.model.path if item.model else "",
                     item.model.max_model_len if item.model else "")  # fmt: skip

    def secret_value(self, namespace: str) -> Callable[[str, str], str | None]:
        def lookup(name: str, key: str) -> str | None:
            data = ((self.api.secret(namespace, name) or {}).get("data") or {})
            return base64.b64decode(data[key]).decode() if key in data else None

        return lookup

    def write_secret_volumes(self, engine: Engine) -> dict[str, str]:
        """Writes the pod's Secret volumes into local folders (as the kubelet mounts them); mount path -> folder."""
        pod = engine.pod
        mounts = {}
        engine.secret_digests = {}
        for volume in pod.secret_volumes:
            secret = self.api.secret(pod.namespace, volume.secret)
            if secret is None and not volume.optional:
                raise MissingSecret(f"secret {volume.secret!r} (volume {volume.volume}) not found")
            files = secret_files(volume, _secret_data(secret))
            folder = self.settings.volumes / pod.uid / volume.volume
            shutil.rmtree(folder, ignore_errors=True)
            secret_volumes.write_version(folder, files)
            engine.secret_digests[volume.volume] = secret_volumes.digest(files)
            mounts[volume.mount_path] = str(folder)
        return mounts

    def sync_secret_volumes(self, engine: Engine) -> None:
        """A running engine's Secret volumes follow their Secrets (a new version swapped in atomically); a Secret
        gone since the start leaves the files as they were, as a kubelet does."""
        pod = engine.pod
        for volume in pod.secret_volumes:
            secret = self.api.secret(pod.namespace, volume.secret)
            if secret is None:
                continue
            files = secret_files(volume, _secret_data(secret))
            version = secret_volumes.digest(files)
            if version != engine.secret_digests.get(volume.volume):
                secret_volumes.write_version(self.settings.volumes / pod.uid / volume.volume, files)
                engine.secret_digests[volume.volume] = version
                log.info("pod %s: volume %s updated from Secret %s", pod.ref, volume.volume, volume.secret)

    # --- probes and exits -------------------------------------------------------------------------------------
    def on_probe(self, report: ProbeReport) -> None:
        engine = self.engines.get(report.uid)
        if engine is None or engine.run != report.run or engine.proc is None or engine.stopping:
            return  # about an earlier run, or the engine is on its way out
        verdict: Verdict = report.verdict
        was_ready = engine.container.ready
        container = ContainerState(engine.pod.container, engine.pod.image, engine.restart_count, ready=verdict.ready,
                                   started=verdict.started, running_since=engine.started_iso, last=engine.last,
                                   container_id=engine.container.container_id)  # fmt: skip
        if container != engine.container:
            engine.container, engine.dirty = container, True
        if verdict.ready != was_ready:
            log.info("pod %s: %s", engine.pod.ref, "ready (/health 200)" if verdict.ready else "not ready")
        if verdict.restart and engine.kill_deadline is None:
            log.warning("pod %s: %s; restarting its engine", engine.pod.ref, verdict.restart)
            self.event(engine, "Unhealthy", verdict.restart, "Warning")
            processes.signal_leader(engine.proc.pid, signal.SIGTERM)
            engine.kill_deadline = time.monotonic() + min(engine.pod.grace_s, self.settings.max_grace_s)

    def on_exit(self, engine: Engine, now: float) -> None:
        assert engine.proc is not None
        code = engine.proc.returncode
        processes.signal_group(engine.proc.pid, signal.SIGKILL)  # whatever the engine left in its group
        if engine.prober:
            engine.prober.stop()
        if engine.record:
            processes.remove_record(self.settings.records, engine.record)
        ended = terminated(code, engine.started_iso, now_rfc3339())
        pid = engine.proc.pid
        engine.proc, engine.prober, engine.record, engine.kill_deadline = None, None, None, None
        if engine.stopping:
            log.info("pod %s: engine pid %d stopped (%s)", engine.pod.ref, pid, ended.message or ended.exit_code)
            engine.finished = True
            return
        engine.last = ended
        engine.crashes = 1 if now - engine.started_mono >= 600 else engine.crashes + 1
        engine.phase = phase_after_exit(engine.pod.restart_policy, ended.exit_code)
        if not restarts_after_exit(engine.pod.restart_policy, ended.exit_code):
            engine.container = ContainerState(engine.pod.container, engine.pod.image, engine.restart_count,
                                              terminated=ended)  # fmt: skip
            engine.finished, engine.dirty = True, True
            return
        delay = restart_delay(engine.crashes)
        engine.next_start = now + delay
        log.warning("pod %s: engine pid %d exited (code %d%s); restarting %s", engine.pod.ref, pid, ended.exit_code,
                    f", {ended.message}" if ended.message else "", f"in {delay:.0f} s" if delay else "now")
        if delay:
            self.waiting(engine, "CrashLoopBackOff",
                         f"back-off {delay:.0f}s restarting failed container={engine.pod.container} "
                         f"pod={engine.pod.name}")  # fmt: skip
            self.event(engine, "BackOff", "Back-off restarting failed container", "Warning")
        else:
            self.waiting(engine, "ContainerCreating", "restarting")

    # --- stopping ---------------------------------------------------------------------------------------------
    def stop(self, engine: Engine, delete: bool) -> None:
        """The pod is terminating (delete: remove it once the engine is gone) or gone from the API."""
        engine.stopping = True
        engine.delete_when_stopped = delete
        if engine.prober:
            engine.prober.stop()
        if engine.proc is None:
            engine.finished = True
            return
        grace = min(engine.pod.grace_s, self.settings.max_grace_s)
        log.info("pod %s: %s: SIGTERM to engine pid %d (SIGKILL after %.0f s)", engine.pod.ref,
                 "terminating" if delete else "deleted", engine.proc.pid, grace)  # fmt: skip
        processes.signal_leader(engine.proc.pid, signal.SIGTERM)
        engine.kill_deadline = time.monotonic() + grace
        if not engine.gone:
            self.event(engine, "Killing", "Stopping container engine")
            engine.container = ContainerState(engine.pod.container, engine.pod.image, engine.restart_count,
                                              started=engine.container.started, running_since=engine.started_iso,
                                              last=engine.last, container_id=engine.container.container_id)
            engine.dirty = True

    def shutdown(self, grace_s: float = 8.0) -> None:
        """The engine kubelet stops: every engine it runs stops with it (the pods stay as they are)."""
        running = [e for e in self.engines.values() if e.proc is not None]
        for engine in running:
            if engine.prober:
                engine.prober.stop()
            assert engine.proc is not None
            processes.signal_leader(engine.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for engine in running:
            assert engine.proc is not None
            try:
                engine.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            processes.signal_group(engine.proc.pid, signal.SIGKILL)
            engine.proc.wait()
            if engine.record:
                processes.remove_record(self.settings.records, engine.record)
        if running:
            log.info("stopped %d engine(s)", len(running))

    # --- reporting --------------------------------------------------------------------------------------------
    def event(self, engine: Engine, reason: str, message: str, kind: str = "Normal") -> None:
        """A Kubernetes Event on the pod, as a kubelet records one (best effort)."""
        pod, now = engine.pod, now_rfc3339()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace, "name": pod.name,
                               "uid": pod.uid, "fieldPath": f"spec.containers{{{pod.container}}}"},
            "reason": reason, "message": message, "type": kind, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": COMPONENT, "host": pod.node or ""},
            "reportingComponent": COMPONENT, "reportingInstance": pod.node or "",
        }  # fmt: skip
        try:
            self.api.create_event(pod.namespace, body)
        except (ApiError, httpx.HTTPError) as err:
            log.debug("event %s on %s: %s", reason, pod.ref, err)

    def _publish(self) -> None:
        rows = []
        for engine in self.engines.values():
            pod, c = engine.pod, engine.container
            state = "running" if c.running_since else ("terminated" if c.terminated else "waiting")
            rows.append({
                "namespace": pod.namespace, "pod": pod.name, "uid": pod.uid, "ip": pod.pod_ip, "port": pod.port,
                "pid": engine.proc.pid if engine.proc else None, "model": engine.model, "state": state,
                "reason": (c.waiting or ("", ""))[0] if state == "waiting" else "", "ready": c.ready,
                "restarts": engine.restart_count, "stopping": engine.stopping,
                "log": str(self.settings.logs / engine.log_path_name),
            })  # fmt: skip
        with self._snapshot_lock:
            self._snapshot = rows

    def snapshot(self) -> list[dict[str, Any]]:
        with self._snapshot_lock:
            return list(self._snapshot)


def watch_pods(api: ApiServer, inbox: queue.Queue[Any], stop: threading.Event) -> None:
    """List, then watch from the list's version; list again after a 410 or any error (with back-off)."""
    backoff = 0.5
    while not stop.is_set():
        try:
            pods, version = api.list_pods(ENGINE_SELECTOR)
            inbox.put(Listed(pods))
            backoff = 0.5
            while not stop.is_set():
                for event in api.watch_pods(ENGINE_SELECTOR, version):
                    version = (event.get("object") or {}).get("metadata", {}).get("resourceVersion", version)
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        inbox.put(Watched(event["type"], event["object"]))
        except Gone:
            log.info("pod watch: resource version too old; listing again")
        except (ApiError, httpx.HTTPError, ValueError) as err:
            log.warning("pod watch: %s; listing again in %.1f s", err, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)
