"""When each ModelDeployment's objects reached each stage of the path to Ready, from watches of the apiserver.

One watch per kind (ModelDeployments, Workloads, Deployments, Pods), each a thread that lists, then follows the
stream; every event stamps the first time its ModelDeployment reached a stage. The stages, in order, and who moves
an object from one to the next:

    mdep_created  -> wl_created     the operator (first reconcile creates the Workload)
    wl_created    -> wl_admitted    Kueue (quota reserved and admitted)
    wl_admitted   -> dep_created    the operator (a workload event: the Deployment for the admitted shape)
    dep_created   -> pod_created    kube-controller-manager (Deployment -> ReplicaSet -> Pod)
    pod_created   -> pod_scheduled  kube-scheduler (binding)
    pod_scheduled -> pod_ready      kwok (Running, Ready)
    pod_ready     -> dep_ready      kube-controller-manager (ReplicaSet and Deployment status)
    dep_ready     -> mdep_ready     the operator (a Deployment event: status.readyReplicas, Available)
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import httpx

log = logging.getLogger("opscale.stages")

LABEL_MDEP = "serving.kvfleet.dev/modeldeployment"
STAGES = ("mdep_created", "wl_created", "wl_admitted", "dep_created", "pod_created", "pod_scheduled",
          "pod_ready", "dep_ready", "mdep_ready")
OWNER = {  # who moves an object into the stage
    "wl_created": "operator", "wl_admitted": "kueue", "dep_created": "operator",
    "pod_created": "kube-controller-manager", "pod_scheduled": "kube-scheduler", "pod_ready": "kwok",
    "dep_ready": "kube-controller-manager", "mdep_ready": "operator",
}

Key = tuple[str, str]  # (namespace, ModelDeployment)


def _true(obj: Mapping[str, Any], cond_type: str) -> bool:
    return any(c.get("type") == cond_type and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or ())


def mdep_stages(obj: Mapping[str, Any]) -> list[str]:
    status = obj.get("status") or {}
    wanted = int((obj.get("spec") or {}).get("replicas", 1))
    out = ["mdep_created"]
    if status.get("readyReplicas", 0) >= wanted and _true(obj, "Available"):
        out.append("mdep_ready")
    return out


def workload_stages(obj: Mapping[str, Any]) -> list[str]:
    return ["wl_created", *(["wl_admitted"] if _true(obj, "Admitted") else [])]


def deployment_stages(obj: Mapping[str, Any]) -> list[str]:
    ready = int((obj.get("status") or {}).get("readyReplicas") or 0)
    return ["dep_created", *(["dep_ready"] if ready >= 1 else [])]


def pod_stages(obj: Mapping[str, Any]) -> list[str]:
    out = ["pod_created"]
    if (obj.get("spec") or {}).get("nodeName"):
        out.append("pod_scheduled")
    if _true(obj, "Ready"):
        out.append("pod_ready")
    return out


class StageClock:
    """First time (seconds after `t0`) each ModelDeployment reached each stage; thread-safe."""

    def __init__(self, namespaces: Iterable[str]) -> None:
        self.namespaces = frozenset(namespaces)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self.times: dict[Key, dict[str, float]] = {}
        self.changed = threading.Condition(self._lock)

    def start(self) -> None:
        with self._lock:
            self.t0 = time.monotonic()
            self.times.clear()

    def stamp(self, key: Key, stages: Sequence[str]) -> None:
        if key[0] not in self.namespaces:
            return
        now = time.monotonic() - self.t0
        with self._lock:
            seen = self.times.setdefault(key, {})
            for stage in stages:
                seen.setdefault(stage, now)
            self.changed.notify_all()

    def count(self, stage: str) -> int:
        with self._lock:
            return sum(1 for t in self.times.values() if stage in t)

    def wait(self, stage: str, n: int, timeout: float, progress: Callable[[], None] = lambda: None) -> bool:
        """Until `n` ModelDeployments reached `stage` (True) or `timeout` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        last_progress = time.monotonic()
        with self._lock:
            while sum(1 for t in self.times.values() if stage in t) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 1.0))
                if time.monotonic() - last_progress >= 5:
                    last_progress = time.monotonic()
                    self._lock.release()
                    try:
                        progress()
                    finally:
                        self._lock.acquire()
        return True

    def snapshot(self) -> dict[Key, dict[str, float]]:
        with self._lock:
            return {k: dict(v) for k, v in self.times.items()}


class Watch(threading.Thread):
    """List, then watch, one collection; feed every object to `on_object`. Relists after a 410."""

    def __init__(self, client: httpx.Client, path: str, on_object: Callable[[Mapping[str, Any]], None],
                 label_selector: str | None = None) -> None:
        super().__init__(daemon=True, name=f"watch {path}")
        self.client, self.path, self.on_object = client, path, on_object
        self.params = {"labelSelector": label_selector} if label_selector else {}
        self.stopping = threading.Event()
        self.listed = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                rv = self._list()
                self.listed.set()
                while not self.stopping.is_set() and rv is not None:
                    rv = self._follow(rv)
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("watch %s: %r; again", self.path, exc)
                time.sleep(0.5)

    def _list(self) -> str:
        resp = self.client.get(self.path, params=self.params)
        resp.raise_for_status()
        body = resp.json()
        for item in body.get("items") or ():
            self.on_object(item)
        return str(body["metadata"]["resourceVersion"])

    def _follow(self, rv: str) -> str | None:
        """Follow from `rv`; the last resourceVersion seen, or None to relist."""
        params = {**self.params, "watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                  "timeoutSeconds": "20"}
        with self.client.stream("GET", self.path, params=params, timeout=httpx.Timeout(10, read=40)) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return None  # 410 Gone: too old, list again
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self.on_object(obj)
                if self.stopping.is_set():
                    break
        return rv


def http_client(kubeconfig: str) -> httpx.Client:
    """An httpx client for the apiserver of a kubeconfig (client certificates, as the local cluster's admin)."""
    from kvfleet.operator.credentials import from_kubeconfig

    creds = from_kubeconfig(kubeconfig)
    return httpx.Client(base_url=creds.server, verify=creds.ssl_context(), timeout=30,
                        limits=httpx.Limits(max_connections=16, max_keepalive_connections=16))


def start_watches(client: httpx.Client, clock: StageClock) -> list[Watch]:
    """The four watches, started; returns once each has listed."""

    def by_label(stages: Callable[[Mapping[str, Any]], list[str]]) -> Callable[[Mapping[str, Any]], None]:
        def on_object(obj: Mapping[str, Any]) -> None:
            meta = obj.get("metadata") or {}
            mdep = (meta.get("labels") or {}).get(LABEL_MDEP)
            if mdep and not meta.get("deletionTimestamp"):
                clock.stamp((meta.get("namespace", ""), mdep), stages(obj))
        return on_object

    def on_mdep(obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        clock.stamp((meta.get("namespace", ""), meta.get("name", "")), mdep_stages(obj))

    watches = [
        Watch(client, "/apis/serving.kvfleet.dev/v1alpha1/modeldeployments", on_mdep),
        Watch(client, "/apis/kueue.x-k8s.io/v1beta2/workloads", by_label(workload_stages), LABEL_MDEP),
        Watch(client, "/apis/apps/v1/deployments", by_label(deployment_stages), LABEL_MDEP),
        Watch(client, "/api/v1/pods", by_label(pod_stages), LABEL_MDEP),
    ]
    for w in watches:
        w.start()
    for w in watches:
        if not w.listed.wait(60):
            raise TimeoutError(f"{w.name}: no list in 60 s")
    return watches


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _stats(values: Sequence[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(_pct(values, 0.5), 2), "p90": round(_pct(values, 0.9), 2),
            "max": round(max(values), 2), "min": round(min(values), 2)}


def summarize(times: Mapping[Key, Mapping[str, float]], step: float = 5.0) -> dict[str, Any]:
    """Per stage: when the ModelDeployments reached it (seconds after the apply); per transition: how long each
    object spent in it, and who owns it; and how many had reached each stage every `step` seconds."""
    reached = {s: [t[s] for t in times.values() if s in t] for s in STAGES}
    transitions = {}
    for a, b in zip(STAGES, STAGES[1:], strict=False):
        deltas = [t[b] - t[a] for t in times.values() if a in t and b in t]
        transitions[f"{a}->{b}"] = {"owner": OWNER[b], **_stats(deltas)}
    end = max((max(v) for v in reached.values() if v), default=0.0)
    progress = []
    tick = 0.0
    while tick <= end + step:
        progress.append({"t": tick, **{s: sum(1 for x in reached[s] if x <= tick) for s in STAGES}})
        tick += step
    return {"stages": {s: _stats(v) for s, v in reached.items()}, "transitions": transitions,
            "progress": progress}
