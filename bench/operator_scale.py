"""The operator at scale: N Tenants x M ModelDeployments of one replica, from `kubectl apply` to all Ready.

A benchmark, not a test: run it by hand on the local cluster (it starts one with enough H200 nodes when none runs,
and stops it at the end unless --keep-cluster). Each run starts a fresh operator, makes the Tenants (timed apart),
then applies every ModelDeployment in one `kubectl apply` and waits until each has status.readyReplicas = 1 and
Available=True. It writes one JSON per run under bench/results/operator-scale/ with:

- total_s: apply -> all Ready; tenants_ready_s;
- stages/transitions: when the objects reached each stage (workload, admission, Deployment, pod, scheduled,
  ready...) and how long each spent in each step, with the component that owns the step (opscale/stages.py);
- cpu_s: CPU seconds of every local-cluster process and of the operator over the window, the machine's busy
  CPU seconds (the 2 cores are shared: what the others used is the difference), load averages;
- memory: the operator's peak RSS (VmHWM) and each component's RSS at the end;
- requests: apiserver request counts by verb/resource, APF wait, etcd time; client-go's requests and
  rate-limiter wait of the controller manager, scheduler and Kueue; the operator's own requests and reconciles;
- profile (with --profile): py-spy's top functions of the operator (a separate run: sampling costs CPU).

kwok marks pods Ready as soon as they run: the benchmark stops the cluster's engine kubelet and gives kwok its stock
pod stages (opscale/kwok_engines.py; 200 real engines do not fit this machine, and would measure engine start-up).
Ready here is the ModelDeployment's status.
Run it at the niceness the cluster runs at (not under `nice` when the cluster is not): on a shared, busy machine a
niced operator gets a smaller share than the control plane and looks slower than it is. Each component's nice
value is in the result. `--operator-src DIR` runs the operator from another checkout's operator/ (e.g. `git
archive REV operator | tar -x -C DIR`) to compare revisions in one period.

    .venv/bin/python bench/operator_scale.py --label before --repeat 3
    .venv/bin/python bench/operator_scale.py --label before-profile --profile
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvfleet.operator.kube import Kube  # noqa: E402
from kvfleet.operator.testing import OperatorProcess, install_crds, wait_for  # noqa: E402

from localcluster import components as comps  # noqa: E402
from localcluster import control, procs  # noqa: E402
from localcluster.layout import Layout  # noqa: E402
from opscale import kwok_engines, procstat, profile, scrape, stages  # noqa: E402
from provenance import git_describe  # noqa: E402

log = logging.getLogger("operator_scale")

API = "serving.kvfleet.dev/v1alpha1"
KUEUE = "kueue.x-k8s.io/v1beta2"
FLAVOR = "bench-h200"
GPUS_PER_H200 = 8


def _kubectl(layout: Layout) -> Any:
    def run(*args: str, stdin: str | None = None) -> str:
        return control.kubectl(layout, *args, stdin=stdin)
    return run


def is_up(layout: Layout) -> bool:
    """Up as `make cluster-up` leaves it, or as an earlier run of this benchmark left it (no engine kubelet)."""
    unhealthy = [s.name for s in control.states(layout) if not s.healthy]
    return layout.kubeconfig.exists() and (
        not unhealthy or (unhealthy == ["engine-kubelet"] and kwok_engines.engines_by_kwok_already(layout)))


def ensure_cluster(layout: Layout, gpus: int, nodes: str) -> bool:
    """A running cluster with at least `gpus` H200 GPUs, started with `nodes` when none runs. True if started."""
    if not is_up(layout):
        log.info("starting the local cluster with %s", nodes)
        control.up(layout, nodes)
        return True
    out = control.kubectl(layout, "get", "nodes", "-l", "kvfleet.dev/gpu-flavor=h200", "-o",
                          "jsonpath={.items[*].status.allocatable.nvidia\\.com/gpu}")
    have = sum(int(x) for x in out.split())
    if have < gpus:
        raise SystemExit(f"the running cluster has {have} H200 GPUs, the benchmark needs {gpus}: "
                         f"`make cluster-down`, then run again (it starts one with {nodes})")
    return False


def tenant(name: str, per_tenant: int) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "Tenant", "metadata": {"name": name},
            "spec": {"namespaces": [name], "quotas": [{"flavor": FLAVOR, "nominal": per_tenant}]}}


def model_deployment(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                     "engine": {"kind": "kvfleet", "tensorParallelSize": 1},
                     "resources": {"gpuFlavor": FLAVOR, "cpu": "2", "memory": "8Gi"},
                     "replicas": 1}}


METRICS_READER = [
    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "bench-metrics", "namespace": "default"}},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "bench-metrics"},
     "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "bench-metrics"},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "bench-metrics"},
     "subjects": [{"kind": "ServiceAccount", "name": "bench-metrics", "namespace": "default"}]},
]


def metrics_token(layout: Layout) -> str:
    """A token that may read /metrics: Kueue's metrics server authenticates bearer tokens only (TokenReview)."""
    control.kubectl(layout, "apply", "-f", "-", stdin="\n---\n".join(json.dumps(o) for o in METRICS_READER))
    return control.kubectl(layout, "create", "token", "bench-metrics", "-n", "default", "--duration=2h").strip()


def endpoints(layout: Layout, operator: OperatorProcess, token: str) -> list[scrape.Endpoint]:
    cert, key = layout.pki / "admin.crt", layout.pki / "admin.key"
    return [
        scrape.Endpoint("kube-apiserver", f"{layout.apiserver_url}/metrics", cert, key),
        scrape.Endpoint("kube-controller-manager",
                        f"https://127.0.0.1:{layout.port('controller_manager')}/metrics", cert, key),
        scrape.Endpoint("kube-scheduler", f"https://127.0.0.1:{layout.port('scheduler')}/metrics", cert, key),
        scrape.Endpoint("kueue", f"https://127.0.0.1:{layout.port('kueue_metrics')}/metrics", token=token),
        scrape.Endpoint("operator", f"http://127.0.0.1:{operator.metrics_port}/metrics"),
    ]


REDUCE = {"kube-apiserver": scrape.APISERVER, "kube-controller-manager": scrape.CLIENT,
          "kube-scheduler": scrape.CLIENT, "kueue": scrape.KUEUE, "operator": scrape.OPERATOR}


def scrape_all(eps: list[scrape.Endpoint]) -> dict[str, dict[scrape.Key, float]]:
    out = {}
    for ep in eps:
        try:
            out[ep.name] = scrape.reduce(scrape.fetch(ep), REDUCE[ep.name])
        except OSError as exc:  # one component's metrics missing is worth a note, not a failed run
            log.warning("no metrics from %s: %s", ep.name, exc)
            out[ep.name] = {}
    return out


def pids(layout: Layout, operator: OperatorProcess) -> dict[str, int]:
    out = {name: pid for name in comps.ORDER if (pid := procs.running_pid(layout.run, name)) is not None}
    assert operator.proc is not None
    out["operator"] = operator.proc.pid
    out["benchmark"] = os.getpid()
    return out


def cpu_now(pid_of: dict[str, int]) -> dict[str, procstat.ProcSample | None]:
    return {name: procstat.sample(pid) for name, pid in pid_of.items()}


def teardown(kube: Kube, layout: Layout, names: list[str], timeout: float = 600) -> None:
    """Delete the run's Tenants and namespaces and wait until the namespaces are gone: their pods hold the nodes'
    GPUs, and the clean-up (garbage collector, namespace controller) must not run into the next run's window."""
    for name in names:
        kube.delete(API, "tenants", name)
        kube.delete("v1", "namespaces", name)
    wait_for("the run's namespaces gone", lambda: all(kube.get("v1", "namespaces", ns) is None for ns in names),
             timeout=timeout, interval=3)


def run_once(args: argparse.Namespace, layout: Layout, kube: Kube, client: Any) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:4]
    names = [f"s{run_id}-t{i:02d}" for i in range(args.tenants)]
    n_mdeps = args.tenants * args.per_tenant
    env = {"KVFLEET_SYSTEM_NAMESPACES": "kvfleet-system", **dict(kv.split("=", 1) for kv in args.operator_env)}
    if args.operator_src:
        env["PYTHONPATH"] = os.pathsep.join([str(args.operator_src.resolve()), os.environ.get("PYTHONPATH", "")])
    log_path = layout.logs / f"operator-bench-{run_id}.log"
    operator = OperatorProcess(str(layout.kubeconfig), log_path, env=env).start()
    result: dict[str, Any] = {"label": args.label, "run_id": run_id, "git": git_describe(),
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "params": {"tenants": args.tenants, "per_tenant": args.per_tenant,
                                         "model_deployments": n_mdeps, "replicas_each": 1,
                                         "operator_env": env, "profile": args.profile,
                                         "operator_src": str(args.operator_src or "")},
                              "machine": {"cores": os.cpu_count(), "loadavg_start": os.getloadavg()},
                              "operator_log": str(log_path)}
    try:
        clock = stages.StageClock(names)
        watches = stages.start_watches(client, clock)
        t_tenants = time.monotonic()
        for name in names:
            kube.apply(tenant(name, args.per_tenant))
        def tenant_ready(name: str) -> bool:
            return bool(kube.get(KUEUE, "localqueues", name, name)) and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in ((kube.get(API, "tenants", name) or {}).get("status") or {}).get("conditions") or ())

        for name in names:
            wait_for(f"tenant {name} ready", lambda name=name: tenant_ready(name), timeout=args.timeout, interval=0.5)
        result["tenants_ready_s"] = round(time.monotonic() - t_tenants, 2)
        # Let the tenants' own work (status refreshes) settle before the clock starts.
        time.sleep(2)

        pid_of = pids(layout, operator)
        eps = endpoints(layout, operator, metrics_token(layout))
        metrics_before = scrape_all(eps)
        cpu_before, machine_before = cpu_now(pid_of), procstat.machine_cpu_s()
        spy = None
        if args.profile:
            profile_path = args.out / f"{args.label}-{run_id}-pyspy.txt"
            spy = profile.start(pid_of["operator"], profile_path)
        docs = "\n---\n".join(json.dumps(model_deployment(f"m{j:02d}", ns))
                              for ns in names for j in range(args.per_tenant))
        clock.start()
        control.kubectl(layout, "apply", "-f", "-", stdin=docs)
        result["apply_s"] = round(time.monotonic() - clock.t0, 2)
        series = []

        def progress() -> None:
            row = {"t": round(time.monotonic() - clock.t0, 1),
                   **{s: clock.count(s) for s in ("wl_created", "wl_admitted", "dep_created", "pod_ready",
                                                  "mdep_ready")},
                   "cpu_s": {k: v.cpu_s for k, v in cpu_now(pid_of).items() if v}}
            series.append(row)
            log.info("t=%5.1fs %s", row["t"], " ".join(f"{k}={v}" for k, v in row.items() if k not in ("t", "cpu_s")))

        done = clock.wait("mdep_ready", n_mdeps, args.timeout, progress)
        total = time.monotonic() - clock.t0
        cpu_after, machine_after = cpu_now(pid_of), procstat.machine_cpu_s()
        metrics_after = scrape_all(eps)
        if spy is not None:
            profile.stop(spy)
            raw = profile_path.read_text() if profile_path.exists() else ""
            result["profile"] = {"file": str(profile_path.relative_to(REPO)), **profile.top_functions(raw)}
        for w in watches:
            w.stopping.set()

        result["complete"] = done
        result["total_s"] = round(total, 2)
        result["ready"] = clock.count("mdep_ready")
        result.update(stages.summarize(clock.snapshot()))
        result["cpu_s"] = {name: round(cpu_after[name].cpu_s - cpu_before[name].cpu_s, 2)  # type: ignore[union-attr]
                           for name in pid_of if cpu_before.get(name) and cpu_after.get(name)}
        result["cpu_s"]["machine_busy"] = round(machine_after - machine_before, 2)
        result["cpu_s"]["machine_capacity"] = round(total * (os.cpu_count() or 1), 2)
        result["cpu_s"]["others"] = round(result["cpu_s"]["machine_busy"] - sum(
            v for k, v in result["cpu_s"].items() if k in pid_of), 2)
        result["memory_mib"] = {name: asdict(s) for name, s in cpu_after.items() if s}
        result["operator_peak_rss_mib"] = cpu_after["operator"].peak_rss_mib if cpu_after["operator"] else None
        result["requests"] = {name: scrape.as_rows(scrape.diff(metrics_after[name], metrics_before.get(name, {})))
                              for name in metrics_after}
        result["cpu_series"] = series
        result["machine"]["loadavg_end"] = os.getloadavg()
        errors = [line for line in operator.log_text().splitlines() if "Traceback" in line or " ERROR " in line]
        result["operator_log_errors"] = len(errors)
        result["operator_log_error_lines"] = [line[:300] for line in errors[:10]]
    finally:
        operator.stop()
        teardown(kube, layout, names)
    return result


def print_summary(r: dict[str, Any]) -> None:
    print(f"\n== {r['label']} run {r['run_id']}: {r['ready']}/{r['params']['model_deployments']} Ready in "
          f"{r['total_s']} s (tenants ready in {r['tenants_ready_s']} s; load {r['machine']['loadavg_start'][0]:.1f}"
          f" -> {r['machine']['loadavg_end'][0]:.1f})")
    for name, st in r["stages"].items():
        print(f"  {name:<14} all by {st.get('max', '-'):>7} s   p50 {st.get('p50', '-'):>7} s")
    for name, st in r["transitions"].items():
        print(f"  {name:<30} {st['owner']:<24} p50 {st.get('p50', '-'):>6}  p90 {st.get('p90', '-'):>6}  "
              f"max {st.get('max', '-'):>6}")
    print("  CPU s: " + ", ".join(f"{k} {v}" for k, v in r["cpu_s"].items()))
    print(f"  operator peak RSS {r['operator_peak_rss_mib']:.0f} MiB; operator log errors {r['operator_log_errors']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--per-tenant", type=int, default=10, help="ModelDeployments (of one replica) per tenant")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--label", default="run", help="names the result files (e.g. before, after-<change>)")
    parser.add_argument("--profile", action="store_true", help="sample the operator with py-spy")
    parser.add_argument("--operator-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of the operator (e.g. KVFLEET_MAX_WORKERS=16)")
    parser.add_argument("--operator-src", type=Path, help="run the operator from this operator/ source root")
    parser.add_argument("--nodes", default="h200=26", help="node mix when the benchmark starts the cluster")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "operator-scale")
    parser.add_argument("--keep-cluster", action="store_true", help="leave a cluster this run started")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)

    layout = Layout.for_checkout()
    started = ensure_cluster(layout, args.tenants * args.per_tenant, args.nodes)
    layout = Layout.for_checkout()
    try:
        kwok_engines.engines_by_kwok(layout)
        install_crds(_kubectl(layout))
        control.kubectl(layout, "apply", "-f", "-", stdin=json.dumps({
            "apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
            "spec": {"nodeLabels": {"kvfleet.dev/gpu-flavor": "h200"}}}))
        kube = Kube.from_kubeconfig(str(layout.kubeconfig))
        client = stages.http_client(str(layout.kubeconfig))
        for _ in range(args.repeat):
            result = run_once(args, layout, kube, client)
            path = args.out / f"{args.label}-{time.strftime('%Y%m%dT%H%M%S')}-{result['run_id']}.json"
            path.write_text(json.dumps(result, indent=1) + "\n")
            print_summary(result)
            print(f"  -> {path.relative_to(REPO)}")
    finally:
        if started and not args.keep_cluster:
            control.down(layout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
