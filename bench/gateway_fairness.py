"""Fairness at the gateway: a quiet tenant's time to first token while another tenant floods the same model.

One real `kvfleet serve` engine (CPU, a tiny random-weight model, `--max-num-seqs` slots) serves one model that two
tenants share (`sharedWith`); the gateway knows the model's slots (`maxNumSeqs` in its static config), so once they
are all taken requests wait at the gateway in per-tenant queues. Phases, each with a fresh gateway on the same
engine:

- `solo`: the quiet tenant alone: `--quiet-requests` streaming requests one after another (a pause between);
- `fifo`: the same quiet requests while the flood tenant (its own client process) keeps `--flood-concurrency`
  long requests in flight (more than the engine's slots), the gateway serving waiting requests in arrival
  order (the baseline);
- `vtc`: the same with the virtual token counter (`--fairness vtc`, the default).

Reported: the quiet tenant's TTFT p50/p90 per phase and the ratios to solo (goal: vtc within 1.5x), the flood's
completed requests and tokens. Noisy on a shared 2-core machine: ratios are measured side by side in one run.

    .venv/bin/python bench/gateway_fairness.py --label v1   # -> bench/results/gateway/fairness-v1.json
    .venv/bin/python bench/gateway_fairness.py --on-cluster --label cluster-v1   # the same on the local cluster:
        # Tenants, the flood's ModelDeployment shared with the quiet tenant (an engine pod), keys in Secrets
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

from kvfleet.gateway.testing import Engine, GatewayProcess, start_engines

from provenance import git_describe

QUIET_KEY, FLOOD_KEY = "quiet-key-0123456789abcdef", "flood-key-0123456789abcdef"
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gateway"
API, KUEUE = "serving.kvfleet.dev/v1alpha1", "kueue.x-k8s.io/v1beta2"


async def stream_once(client: httpx.AsyncClient, url: str, key: str, prompt: str, max_tokens: int) -> float | None:
    """One streaming completion; seconds to its first token, None if it failed."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "min_tokens": max_tokens,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                if json.loads(line[6:])["choices"][0].get("text"):
                    first = time.perf_counter() - start
    return first


async def flood_loop(url: str, concurrency: int, tokens: int, stop: Any, counts: Any) -> None:
    """The flooding tenant: `concurrency` streams back to back until `stop` is set (its own process)."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, trust_env=False, limits=limits) as client:
        async def worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                got = await stream_once(client, url, FLOOD_KEY, f"flood {i}.{n} " + "lorem ipsum " * 20, tokens)
                with counts.get_lock():
                    counts[0 if got is not None else 1] += 1
                n += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def flood_process(url: str, concurrency: int, tokens: int, stop: Any, counts: Any, nice: int = 0) -> None:
    if nice:  # the flood's client stands for remote clients: here its CPU comes out of the server's cores
        os.nice(nice)
    asyncio.run(flood_loop(url, concurrency, tokens, stop, counts))


async def quiet_loop(url: str, args: argparse.Namespace) -> tuple[list[float], int]:
    ttfts: list[float] = []
    failed = 0
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        for i in range(args.quiet_requests):
            got = await stream_once(client, url, QUIET_KEY, f"quiet question {i}: what is a cache?",
                                    args.quiet_tokens)
            if got is None:
                failed += 1
            else:
                ttfts.append(got * 1000)
            await asyncio.sleep(args.quiet_gap_s)
    return ttfts, failed


def phase(url: str, args: argparse.Namespace, flood: bool) -> dict[str, Any]:
    """The quiet tenant's requests, with the flood (a separate process, as a separate client is) or alone."""
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("i", 2)
    proc = ctx.Process(target=flood_process, args=(url, args.flood_concurrency, args.flood_tokens, stop, counts,
                                                   args.flood_nice))
    if flood:
        proc.start()
        time.sleep(args.warmup_s)  # let the flood fill the engine's slots and the gateway's queue first
    try:
        ttfts, failed = asyncio.run(quiet_loop(url, args))
    finally:
        stop.set()
        if flood:
            proc.join(300)
    ttfts.sort()
    return {"quiet_ttft_ms": {"p50": statistics.median(ttfts), "p90": ttfts[int(0.9 * (len(ttfts) - 1))],
                              "mean": statistics.fmean(ttfts), "n": len(ttfts)},
            "quiet_failed": failed, "flood": {"completed": counts[0], "failed": counts[1]}}


def static_gateway(name: str, engine: Engine, args: argparse.Namespace, tmp: Path, fairness: str) -> GatewayProcess:
    """A gateway reading a static config: the flood tenant's model (on `engine`) shared with the quiet tenant."""
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"tenants": {
        "flood": {"keys": [FLOOD_KEY], "models": {"tiny": {"replicas": [engine.url], "maxNumSeqs": args.max_num_seqs,
                                                           "sharedWith": ["quiet"]}}},
        "quiet": {"keys": [QUIET_KEY]}}}))
    return GatewayProcess(tmp / f"gateway-{name}.log", config=config,
                          args=["--fairness", fairness, "--log-level", "warning", "--scrape-interval", "0.5"])


def run_phase(name: str, make_gateway: Callable[[str, str], GatewayProcess],
              args: argparse.Namespace) -> dict[str, Any]:
    fairness = "fifo" if name == "fifo" else "vtc"
    gw = make_gateway(name, fairness)
    try:
        gw.start()
        out = phase(gw.url, args, flood=name != "solo")
        out["gateway_queue_wait_s"] = {t: gw.metric("kvfleet_gateway_queue_wait_seconds_sum", tenant=t)
                                       for t in ("flood", "quiet")}
        out["gateway_waits"] = {t: gw.metric("kvfleet_gateway_queue_wait_seconds_count", tenant=t)
                                for t in ("flood", "quiet")}
    finally:
        gw.stop()
    out["phase"] = name
    return out


class ClusterSetup:
    """On the local cluster (`make cluster-up`): the operator, Tenants `flood` and `quiet` (suffixed), the flood's
    ModelDeployment `tiny` (1 replica, `maxNumSeqs`, shared with quiet) served by a real engine pod, key Secrets."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        sys.path[:0] = [str(REPO / "e2e"), str(REPO / "e2e" / "cluster")]
        from kvfleet.operator.kube import Kube
        from kvfleet.operator.testing import OperatorProcess, flavor_objects, install_crds, wait_for

        from local_engines import use_test_model
        from localcluster import control
        from localcluster.layout import Layout

        control.up(Layout.for_checkout())
        self.layout = layout = Layout.for_checkout()
        self.kubeconfig = str(layout.kubeconfig)
        self.kube = kube = Kube.from_kubeconfig(self.kubeconfig)
        install_crds(self.kubectl)
        sfx = uuid.uuid4().hex[:5]
        self.sfx, self.keys_ns = sfx, f"fair-keys-{sfx}"
        self.operator = OperatorProcess(self.kubeconfig, tmp / "operator.log").start()
        flavor = flavor_objects(sfx, ("h200",))[0]
        kube.apply(flavor)
        self.flavor = flavor["metadata"]["name"]
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.keys_ns}})
        self.tenants = {t: f"fair-{t}-{sfx}" for t in ("flood", "quiet")}
        for t, key in (("flood", FLOOD_KEY), ("quiet", QUIET_KEY)):
            name = self.tenants[t]
            self.kubectl("create", "secret", "generic", f"{t}-keys", f"--namespace={self.keys_ns}",
                         f"--from-literal=k={key}")
            kube.apply({"apiVersion": API, "kind": "Tenant", "metadata": {"name": name},
                        "spec": {"namespaces": [name], "quotas": [{"flavor": self.flavor, "nominal": 1}],
                                 "gateway": {"apiKeySecrets": [{"name": f"{t}-keys"}]}}})
            wait_for(f"LocalQueue of {name}", lambda n=name: kube.get(KUEUE, "localqueues", n, n), timeout=60)
            use_test_model(kube, name)
        ns = self.tenants["flood"]
        kube.apply({"apiVersion": API, "kind": "ModelDeployment", "metadata": {"name": "tiny", "namespace": ns},
                    "spec": {"model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedName": "tiny"},
                             "engine": {"kind": "kvfleet", "maxNumSeqs": args.max_num_seqs},
                             "resources": {"gpuFlavor": self.flavor, "cpu": "2", "memory": "8Gi"}, "replicas": 1,
                             "gateway": {"sharedWith": [self.tenants["quiet"]]}}})
        wait_for("tiny ready", lambda: ((kube.get(API, "modeldeployments", "tiny", ns) or {}).get("status") or {})
                 .get("readyReplicas") == 1, timeout=600)
        self.tmp = tmp

    def kubectl(self, *args: str) -> None:
        argv = [str(self.layout.binary("kubectl")), f"--kubeconfig={self.kubeconfig}", *args]
        subprocess.run(argv, check=True, capture_output=True, text=True)  # noqa: S603

    def gateway(self, name: str, fairness: str) -> GatewayProcess:
        return GatewayProcess(self.tmp / f"gateway-{name}.log", kubeconfig=self.kubeconfig,
                              args=["--keys-namespace", self.keys_ns, "--fairness", fairness, "--log-level", "warning",
                                    "--scrape-interval", "0.5"])

    def close(self) -> None:
        for t in ("flood", "quiet"):
            ns = self.tenants[t]
            self.kube.delete(API, "modeldeployments", "tiny", ns)
        for t in ("flood", "quiet"):
            self.kube.delete(API, "tenants", self.tenants[t])
            self.kube.delete("v1", "namespaces", self.tenants[t])
        self.kube.delete("v1", "namespaces", self.keys_ns)
        self.kube.delete(KUEUE, "resourceflavors", self.flavor)
        self.operator.stop()


def pin_apart(engine_pid: int, cpu: int) -> None:
    """The engine's threads on `cpu`; this process, and so the gateways and the flood started after, on the rest."""
    others = set(os.sched_getaffinity(0)) - {cpu}
    if cpu not in os.sched_getaffinity(0) or not others:
        raise SystemExit(f"--engine-cpu {cpu}: needs that CPU and at least one other in this process's affinity")
    subprocess.run(["taskset", "-a", "-c", "-p", str(cpu), str(engine_pid)], check=True, capture_output=True)
    os.sched_setaffinity(0, others)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="local")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--flood-concurrency", type=int, default=16)
    parser.add_argument("--flood-tokens", type=int, default=64)
    parser.add_argument("--quiet-requests", type=int, default=30)
    parser.add_argument("--quiet-tokens", type=int, default=8)
    parser.add_argument("--quiet-gap-s", type=float, default=0.3)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--phases", default="solo,vtc,fifo")
    parser.add_argument("--repeats", type=int, default=1, help="run the phases this many times in turn")
    parser.add_argument("--flood-nice", type=int, default=0,
                        help="nice the flood's client process (it stands for remote clients; on one machine its CPU "
                             "comes out of the server's)")
    parser.add_argument("--engine-cpu", type=int, default=None,
                        help="pin the engine (all its threads) to this CPU and everything else (gateway, clients) to "
                             "the others, as an engine pod with its own cores would be (not with --on-cluster)")
    parser.add_argument("--on-cluster", action="store_true",
                        help="on the local cluster (make cluster-up): Tenants, a shared ModelDeployment, an engine pod")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gw-fair-"))
    phases: dict[str, dict[str, Any]] = {}
    close: Callable[[], None]
    make_gateway: Callable[[str, str], GatewayProcess]
    if args.on_cluster:
        setup = ClusterSetup(args, tmp)
        make_gateway, close = setup.gateway, setup.close
    else:
        from kvfleet.engine.testing import make_tiny_model

        model = make_tiny_model("llama", tmp / "models", max_position_embeddings=1024)
        engines = start_engines(Path(model), tmp, 1, "--max-model-len", "1024", "--max-num-seqs",
                                str(args.max_num_seqs), timeout=600)
        if args.engine_cpu is not None:
            pin_apart(engines[0].proc.pid, args.engine_cpu)

        def make_gateway(name: str, fairness: str) -> GatewayProcess:
            return static_gateway(name, engines[0], args, tmp, fairness)

        def close() -> None:
            for e in engines:
                e.stop()
    try:
        for rep in range(1, args.repeats + 1):  # the phases in turn, again: slow drift of the machine hits all
            for name in args.phases.split(","):
                key = f"{name}#{rep}"
                phases[key] = run_phase(name, make_gateway, args)
                q = phases[key]["quiet_ttft_ms"]
                print(f"{key}: quiet TTFT p50 {q['p50']:.1f} ms p90 {q['p90']:.1f} ms ({q['n']} ok), "
                      f"flood {phases[key]['flood']}", flush=True)
    finally:
        close()
    ratios: dict[str, list[float]] = {}  # per repeat: each phase's quiet p50 over the same repeat's solo p50
    for rep in range(1, args.repeats + 1):
        solo = phases.get(f"solo#{rep}", {}).get("quiet_ttft_ms", {}).get("p50")
        for name in args.phases.split(","):
            if solo and name != "solo" and f"{name}#{rep}" in phases:
                ratios.setdefault(name, []).append(phases[f"{name}#{rep}"]["quiet_ttft_ms"]["p50"] / solo)
    summary = {n: {"median": statistics.median(r), "each": r} for n, r in ratios.items()}
    result = {"label": args.label, "git": git_describe(),
              "where": "local cluster" if args.on_cluster else "static config",
              "args": {k: str(v) for k, v in vars(args).items()}, "phases": phases,
              "quiet_ttft_p50_ratio_to_solo": summary, "goal": "vtc ratio <= 1.5",
              "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "note": "shared 2-core CPU machine, tiny random-weight model: absolute times are noisy"}}
    out = args.out or RESULTS / f"fairness-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratios to solo (quiet TTFT p50): {summary} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
