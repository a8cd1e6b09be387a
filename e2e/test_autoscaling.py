"""Scenario: autoscaling from real engines' queue depth, through Kueue, within the tenant's quota.

Every pod of the ModelDeployment runs a real ``kvfleet serve`` (CPU, the tiny random-weight model, ``maxNumSeqs``
2), started by the local cluster's engine kubelet on the pod's loopback IP, and is Ready only once its engine
answers /health. ``kvfleet bench serve`` sends a burst to the first replica; the operator's autoscaler reads the
engines' queue depth (scraping the ready pods' ``/metrics``, loopback only, or through a real Prometheus from
Debian's package scraping the pods the test lists from the apiserver, labelled as a PodMonitor would), scales up
by several replicas
at once, Kueue admits only what the tenant's quota allows, and after the load stops the deployment shrinks back
after ``scaleDownDelaySeconds``. Replica counts and pods are read from the API. The scrape run writes its table and
plot (``autoscaling-run.md``, ``autoscaling-run.png``) under ``build/autoscaling-run/`` (git-ignored: a test run
leaves the tree clean); ``KVFLEET_AUTOSCALING_REPORT_DIR=docs`` regenerates the published copy in ``docs/``.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from kvfleet.operator.autoscaler.metrics import MetricsError, parse_load
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import REPO, OperatorProcess, condition, free_port, wait_for

from local_engines import base_url, is_ready
from operator_fixtures import API, engine_pods, mdep_status, model_deployment, workloads

pytestmark = pytest.mark.timeout(420)

INTERVAL_S = 2  # autoscaler timer in these runs (the default is 15 s)
TARGET = 4  # targetQueueDepth per replica
MAX_NUM_SEQS = 2  # per engine: a burst queues up
PROMETHEUS = shutil.which("prometheus")


@dataclass(frozen=True)
class Scenario:
    max_replicas: int
    quota_gpus: int  # the tenant's nominal H200 quota; one GPU per replica
    burst_prompts: int
    delay_s: int  # scaleDownDelaySeconds
    source: str = "scrape"


SCRAPE = Scenario(max_replicas=5, quota_gpus=3, burst_prompts=400, delay_s=15)
PROM = Scenario(max_replicas=3, quota_gpus=2, burst_prompts=250, delay_s=6, source="prometheus")


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real Prometheus (Debian package) scraping the engine pods listed in a file_sd file; (url, sd file).

    Debian builds Prometheus without its Kubernetes discovery, so the test does that part: `Recorder` writes the
    Running pods of the ModelDeployment, read from the apiserver, with the labels a PodMonitor gives them
    (namespace, pod)."""
    if PROMETHEUS is None:
        if os.environ.get("CI"):  # `make test` installs it; in CI a missing binary is a failure, not a skip
            pytest.fail("no prometheus binary: `make system-deps` installs Debian's prometheus")
        pytest.skip("no prometheus binary (make system-deps)")
    binary = str(PROMETHEUS)
    sd_file = tmp_path / "targets.json"
    sd_file.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      "scrape_configs:\n  - job_name: engines\n    file_sd_configs:\n"
                      f"      - files: ['{sd_file}']\n        refresh_interval: 1s\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'db'}",  # noqa: S603
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus ready", lambda: _ok(f"{url}/-/ready"), timeout=30)
        yield url, sd_file
    finally:
        proc.terminate()
        proc.wait(10)


def write_targets(sd_file: Path, pods: list[dict[str, Any]]) -> None:
    """Prometheus file_sd: each Running engine pod's IP and `http` port, labelled namespace and pod."""
    groups = [{"targets": [base_url(p).removeprefix("http://")],
               "labels": {"namespace": p["metadata"]["namespace"], "pod": p["metadata"]["name"]}}
              for p in pods if (p.get("status") or {}).get("phase") == "Running" and p["status"].get("podIP")]
    tmp = sd_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(groups, key=lambda g: g["labels"]["pod"])))
    tmp.replace(sd_file)  # atomic: Prometheus never reads half a file


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def operator(crds: None, kubeconfig: str, cluster: Any, request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    """The operator with a short autoscaler interval and the loopback-only safety switch on; it reads
    Prometheus when the test uses `prometheus_server`, else scrapes the pods."""
    env = {"KVFLEET_AUTOSCALE_INTERVAL": str(INTERVAL_S), "KVFLEET_LOOPBACK_ONLY": "1"}
    if "prometheus_server" in request.fixturenames:
        url, _ = request.getfixturevalue("prometheus_server")
        env.update(KVFLEET_AUTOSCALER_METRICS_SOURCE="prometheus", KVFLEET_AUTOSCALER_PROMETHEUS_URL=url)
    log = Path(cluster.logs) / f"operator-{request.node.name}.log"
    proc = OperatorProcess(kubeconfig, log, env=env).start()
    yield proc
    proc.stop()


def ready_urls(kube: Kube, namespace: str, mdep: str) -> dict[str, str]:
    """Base URLs of the ModelDeployment's Ready pods (Ready: their engine answers /health), by pod name."""
    return {p["metadata"]["name"]: base_url(p) for p in engine_pods(kube, namespace, mdep) if is_ready(p)}


def scrape_depth(urls: dict[str, str]) -> float | None:
    """Waiting + running over the engines, read by the test itself; None when none could be read."""
    total, read = 0.0, 0
    for url in urls.values():
        try:
            waiting, running = parse_load(httpx.get(f"{url}/metrics", timeout=1, trust_env=False).text)
        except (httpx.HTTPError, MetricsError):
            continue
        total, read = total + waiting + running, read + 1
    return total if read else None


class Recorder:
    """Samples the ModelDeployment (from the API) and the engines' queue depth once a second; remembers every pod
    IP it saw and every pod it saw Ready; with `sd_file`, keeps Prometheus' target list of the pods."""

    def __init__(self, kube: Kube, namespace: str, mdep: str, sd_file: Path | None = None) -> None:
        self.kube, self.namespace, self.mdep, self.sd_file = kube, namespace, mdep, sd_file
        self.rows: list[dict[str, Any]] = []
        self.pod_ips: set[str] = set()
        self.ready_pods: set[str] = set()
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)

    def __enter__(self) -> "Recorder":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def mark(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                st = mdep_status(self.kube, self.namespace, self.mdep)
                wls = len(workloads(self.kube, self.namespace, self.mdep))
                pods = engine_pods(self.kube, self.namespace, self.mdep)
            except Exception:
                st, wls, pods = None, None, []
            if self.sd_file is not None and st is not None:
                write_targets(self.sd_file, pods)
            self.pod_ips |= {p["status"]["podIP"] for p in pods if (p.get("status") or {}).get("podIP")}
            urls = {p["metadata"]["name"]: base_url(p) for p in pods if is_ready(p)}
            self.ready_pods |= set(urls)
            if st is not None:
                inputs = (st.get("autoscaler") or {}).get("inputs") or {}
                self.rows.append({
                    "t": self.mark(), "engine_depth": scrape_depth(urls),
                    "observed_depth": inputs.get("queueDepth"), "unknown": len(inputs.get("podsUnknown") or []),
                    "desired": st.get("desiredReplicas"), "workloads": wls,
                    "admitted": st.get("admittedReplicas"), "ready": st.get("readyReplicas"),
                })
            self._stop.wait(1.0)


def report_dir() -> Path:
    out = Path(os.environ.get("KVFLEET_AUTOSCALING_REPORT_DIR") or REPO / "build" / "autoscaling-run")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_report(rows: list[dict[str, Any]], marks: dict[str, float], sc: Scenario, out: Path) -> None:
    """autoscaling-run.md (table) and .png (plot) in `out`, from the recorded samples only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    ts = [r["t"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7.5, 3.9), dpi=90)
    ax1.plot(ts, [r["engine_depth"] if r["engine_depth"] is not None else float("nan") for r in rows],
             color="tab:orange", label="queue depth (waiting+running)")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("requests")
    ax2 = ax1.twinx()
    for key, style in (("desired", "-"), ("admitted", "--"), ("ready", ":")):
        ax2.step(ts, [r[key] or 0 for r in rows], style, where="post", label=f"{key} replicas")
    ax2.axhline(sc.quota_gpus, color="tab:red", linewidth=0.6, label="tenant quota (replicas)")
    ax2.set_ylabel("replicas")
    ax2.set_ylim(0, sc.max_replicas + 1)
    for name, t in marks.items():
        ax1.axvline(t, color="grey", linewidth=0.6)
        ax1.text(t, ax1.get_ylim()[1] * 0.95, name, fontsize=7, rotation=90, va="top")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    fig.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out / "autoscaling-run.png")
    plt.close(fig)

    def cell(v: Any) -> str:
        return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    head = ["t (s)", "engine queue depth", "autoscaler saw", "unknown pods", "desired", "workloads", "admitted",
            "ready"]
    keys = ["t", "engine_depth", "observed_depth", "unknown", "desired", "workloads", "admitted", "ready"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    prev, last_t = None, None
    for r in rows:  # keep a row when something changed, and at least one every 5 s
        sig = tuple(r[k] for k in keys[1:])
        if sig != prev or last_t is None or r["t"] - last_t >= 5:
            table.append("| " + " | ".join(cell(r[k]) for k in keys) + " |")
            last_t = r["t"]
        prev = sig
    text = [
        "# Autoscaling run (generated by `e2e/test_autoscaling.py`)",
        "",
        "Real `kvfleet serve` engines (CPU, tiny random-weight llama, `maxNumSeqs: 2`), one per pod of the",
        "ModelDeployment, run by the local cluster's engine kubelet on the pods' loopback IPs (a pod is Ready once its",
        "engine answers /health); `kvfleet bench serve` sent a burst of "
        f"{sc.burst_prompts} requests to the first replica.",
        f"Autoscaling: minReplicas 1, maxReplicas {sc.max_replicas}, targetQueueDepth {TARGET}, "
        f"scaleDownDelaySeconds {sc.delay_s}, interval {INTERVAL_S} s, metrics from `{sc.source}`; "
        f"tenant quota {sc.quota_gpus} GPUs (1 per replica).",
        "Replica counts are read from the ModelDeployment's status; *engine queue depth* is scraped from the",
        "engines by the test, *autoscaler saw* is `status.autoscaler.inputs.queueDepth`.",
        "",
        "Marks: " + ", ".join(f"{k} at {v:g} s" for k, v in marks.items()) + ".",
        "",
        "![queue depth and replicas over time](autoscaling-run.png)",
        "",
        *table,
        "",
    ]
    (out / "autoscaling-run.md").write_text("\n".join(text), encoding="utf-8")


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; killed afterwards if a failed assertion left them running."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def run_scenario(sc: Scenario, kube: Kube, tenants: Any, flavor: str, operator: OperatorProcess, logs: Path,
                 children: list[Any], sd_file: Path | None = None
                 ) -> tuple[str, list[dict[str, Any]], dict[str, float]]:
    """Burst -> scale-up to maxReplicas (several replicas per decision) -> Kueue admits the quota -> load stops ->
    scale-down after the delay. Returns the namespace, the recorded samples and the time marks."""
    _, ns = tenants.create("autoscale", [{"flavor": flavor, "nominal": sc.quota_gpus}])
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": sc.max_replicas, "targetQueueDepth": TARGET,
                   "scaleDownDelaySeconds": sc.delay_s}
    kube.apply(model_deployment("chat", ns, flavor, replicas=1, tp=1, engine={"maxNumSeqs": MAX_NUM_SEQS},
                                autoscaling=autoscaling))
    marks: dict[str, float] = {}

    def auto() -> dict[str, Any]:
        return mdep_status(kube, ns, "chat").get("autoscaler") or {}

    with Recorder(kube, ns, "chat", sd_file) as rec:
        # One replica, its engine serving (the pod is Ready), and the autoscaler reading it.
        wait_for("one engine serving", lambda: len(urls := ready_urls(kube, ns, "chat")) == 1
                 and scrape_depth(urls) == 0, timeout=180)
        wait_for("autoscaler reads the engine", lambda: (auto().get("inputs") or {}).get("podsRead") == 1,
                 timeout=60)
        assert auto()["inputs"]["metricSource"] == sc.source
        assert mdep_status(kube, ns, "chat")["desiredReplicas"] == 1
        [first_url] = ready_urls(kube, ns, "chat").values()

        marks["burst"] = rec.mark()
        bench_out, bench_log = logs / f"bench-{ns}.json", logs / f"bench-{ns}.log"
        with open(bench_log, "wb") as log:
            bench = subprocess.Popen([sys.executable, "-m", "kvfleet.engine.cli", "bench", "serve",  # noqa: S603
                                      "--base-url", first_url, "--num-prompts", str(sc.burst_prompts),
                                      "--out", str(bench_out)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
        children.append(bench)
        # The burst alone may drain before the admitted pods' engines are up (how long each takes depends on the
        # machine's load), and with it the demand the checks below need: a second client keeps the queue deep
        # until they are done, then stops (its open requests are aborted, as a client that leaves).
        holder = subprocess.Popen([sys.executable, "-m", "kvfleet.engine.cli", "bench", "serve",  # noqa: S603
                                   "--base-url", first_url, "--num-prompts", "20000",
                                   "--max-concurrency", str(4 * TARGET * sc.max_replicas),
                                   "--out", str(logs / f"bench-{ns}-holder.json")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(REPO))
        children.append(holder)

        # Scale-up: the queue is deep, so one decision asks for maxReplicas (not one at a time);
        # Kueue admits only the tenant's quota and the rest wait with Kueue's reason.
        mdep = wait_for("scale-up to maxReplicas", lambda: (m := kube.get(API, "modeldeployments", "chat", ns))
                        and m["status"].get("desiredReplicas") == sc.max_replicas and m, timeout=60)
        marks["scaled up"] = rec.mark()
        decision = mdep["status"]["autoscaler"]["lastDecision"]
        assert (decision["action"], decision["to"]) == ("scale_up", sc.max_replicas), decision
        assert mdep["status"]["autoscaler"]["inputs"]["queueDepth"] > TARGET * (sc.max_replicas - 1)
        # (Ready means each admitted pod's engine started and answers, which takes a while on CPU.)
        mdep = wait_for("quota caps admission", lambda: (m := kube.get(API, "modeldeployments", "chat", ns))
                        and m["status"].get("admittedReplicas") == sc.quota_gpus
                        and m["status"].get("readyReplicas") == sc.quota_gpus and m, timeout=180)
        assert mdep["status"]["pendingReplicas"] == sc.max_replicas - sc.quota_gpus
        assert (condition(mdep, "QuotaExceeded") or {}).get("status") == "True", mdep["status"]
        assert len(ready_urls(kube, ns, "chat")) == sc.quota_gpus  # an engine serving on every admitted pod
        for _ in range(3):  # the autoscaler never asks for more workloads than maxReplicas
            assert len(workloads(kube, ns, "chat")) == sc.max_replicas
            assert len(engine_pods(kube, ns, "chat")) <= sc.quota_gpus
            time.sleep(INTERVAL_S)
        holder.terminate()
        holder.wait(30)

        assert bench.wait(240) == 0, bench_log.read_text(errors="replace")[-2000:]
        marks["load done"] = rec.mark()
        summary = json.loads(bench_out.read_text())
        assert summary["completed"] == sc.burst_prompts and summary["failed"] == 0

        # Scale-down: only after the delay, back to minReplicas, and the quota is released.
        wait_for("scale-down to minReplicas", lambda: mdep_status(kube, ns, "chat").get("desiredReplicas") == 1,
                 timeout=sc.delay_s + 60)
        marks["scaled down"] = rec.mark()
        # The clock for the delay is the engines' own queue as the recorder read it, not the bench's exit: the
        # queue's tail drains to within one replica's target seconds before the last request ends (sooner on a
        # fast machine). The margin is the recorder's sampling (1 s) plus one autoscaler tick.
        last_high = max(r["t"] for r in rec.rows if (r["engine_depth"] or 0) > TARGET)
        assert marks["scaled down"] - last_high >= sc.delay_s - 1 - INTERVAL_S, (marks, last_high)
        wait_for("one workload and one pod left", lambda: len(workloads(kube, ns, "chat")) == 1
                 and len(engine_pods(kube, ns, "chat")) == 1, timeout=60)
        wait_for("one engine left", lambda: len(ready_urls(kube, ns, "chat")) == 1, timeout=30)
        time.sleep(3)  # a few more samples for the record
        st = mdep_status(kube, ns, "chat")
        assert (st["desiredReplicas"], st["admittedReplicas"]) == (1, 1)
        assert all(ipaddress.ip_address(ip).is_loopback for ip in rec.pod_ips), rec.pod_ips

    events = sorted(kube.list("v1", "events", ns), key=lambda e: e.get("lastTimestamp") or "")
    reasons = [e["reason"] for e in events]
    assert "ScaledUp" in reasons and "ScaledDown" in reasons, reasons
    # Not one replica at a time: at most two decisions from 1 to maxReplicas (a tick may land while the burst
    # is still arriving), and the first already adds more than one replica unless the queue was still short.
    ups = sorted(tuple(map(int, re.match(r"scale_up (\d+)->(\d+)", e["message"]).groups()))  # type: ignore[union-attr]
                 for e in events if e["reason"] == "ScaledUp")
    assert ups[0][0] == 1 and ups[-1][1] == sc.max_replicas and len(ups) <= 2, ups
    assert any(b - a >= 2 for a, b in ups), ups
    # Scale-down only after scaleDownDelaySeconds of lower demand, by the autoscaler's own account.
    for down in [e["message"] for e in events if e["reason"] == "ScaledDown"]:
        waited = float(re.search(r"for ([\d.]+)s;", down).group(1))  # type: ignore[union-attr]
        assert waited >= sc.delay_s, down
    if sc.source == "scrape":
        # A pod is Ready only once its engine answers /health, so the autoscaler, which reads Ready pods only,
        # never meets a pod whose engine is still loading: every pod it counts is read. (Through Prometheus a pod
        # may turn Ready a scrape before Prometheus has its series: unknown then, never an idle zero.)
        assert "MetricsUnknown" not in reasons and not any(r["unknown"] for r in rec.rows), \
            [r for r in rec.rows if r["unknown"]]
    metrics = operator.metrics()
    assert f'kvfleet_operator_desired_replicas{{name="chat",namespace="{ns}"}} 1.0' in metrics
    assert "kvfleet_operator_queue_depth{" in metrics
    rows = rec.rows
    assert max(r["engine_depth"] or 0 for r in rows) > TARGET * sc.max_replicas
    assert max(r["admitted"] or 0 for r in rows) == sc.quota_gpus  # never above quota, even while scaling
    assert len(rec.ready_pods) >= sc.quota_gpus
    return ns, rows, marks


def test_burst_scales_up_within_quota_and_back_down(kube: Kube, tenants: Any, flavors: dict[str, str],
                                                    operator: OperatorProcess, cluster: Any,
                                                    children: list[Any]) -> None:
    ns, rows, marks = run_scenario(SCRAPE, kube, tenants, flavors["h200"], operator, Path(cluster.logs), children)
    write_report(rows, marks, SCRAPE, report_dir())
    # Autoscaling off: its status goes, and the spec's replica count rules again.
    kube.merge_patch({"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": "chat", "namespace": ns}},
                     {"spec": {"replicas": 2, "autoscaling": {"enabled": False}}})
    wait_for("autoscaler status dropped, spec replicas used", lambda: (st := mdep_status(kube, ns, "chat"))
             and "autoscaler" not in st and st.get("desiredReplicas") == 2, timeout=30)


def test_prometheus_source_scales_the_same_way(prometheus_server: tuple[str, Path], kube: Kube, tenants: Any,
                                               flavors: dict[str, str], operator: OperatorProcess,
                                               cluster: Any, children: list[Any]) -> None:
    _, sd_file = prometheus_server
    run_scenario(PROM, kube, tenants, flavors["h200"], operator, Path(cluster.logs), children, sd_file)
