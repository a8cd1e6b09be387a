"""kvfleet against vLLM in one lease: the online stage and the summary table (``bench/compare_vllm.sh``).

``online``: start one server (``kvfleet serve`` or ``vllm serve``) with the same limits, time it from
the start of its process to the first ``/health`` 200, load it with ``kvfleet bench serve``'s client at
each load point (token-id prompts of ``random-1024-128``, ``ignore_eos``, streaming), stop it, and
write one JSON per load point plus ``<engine>-startup.json``. Each load point draws its prompts
with its own seed (the same for both engines), so no load point finds another's prompts cached.

``summary``: the issue's table from the JSON files of one or more result folders: offline output
tok/s (kvfleet / vLLM, per model, workload and quantization) and online TTFT/TPOT (vLLM's / ours,
so > 1 means kvfleet is faster), and the start-to-healthy times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# (name, rate in req/s, requests): 0.5 req/s is one request at a time (a 1024/128 request takes ~0.8 s)
DEFAULT_LOADS = "low:0.5:16,r4:4:120,r12:12:240,burst:inf:300"
ONLINE_WORKLOAD = "random-1024-128"


@dataclass(frozen=True)
class LoadPoint:
    name: str
    rate: float
    num_prompts: int
    seed: int


def parse_loads(text: str) -> list[LoadPoint]:
    """``name:rate:requests,...`` (rate ``inf`` = all at once); seeds 1, 2, ... in order."""
    points = []
    for i, item in enumerate(x for x in text.split(",") if x.strip()):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"loads: {item!r} is not name:rate:requests")
        name, rate, num = parts[0], float(parts[1]), int(parts[2])
        if not name or not (rate > 0) or num < 1:
            raise ValueError(f"loads: {item!r} needs a name, a rate > 0 (or inf) and >= 1 request")
        points.append(LoadPoint(name, rate, num, i + 1))
    if not points:
        raise ValueError("loads: no load point given")
    return points


def server_command(engine: str, model: str, port: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int, gpu_memory_utilization: float, quantization: str | None,
                   python: str = sys.executable, dtype: str = "bfloat16", block_size: int | None = None) -> list[str]:
    """The server's command line: the same limits for both (flags named alike in `kvfleet serve`)."""
    common = [model, "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--dtype", dtype,
              "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
              "--max-num-batched-tokens", str(max_num_batched_tokens),
              "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if quantization:
        common += ["--quantization", quantization]
    if block_size is not None:
        common += ["--block-size", str(block_size)]
    if engine == "kvfleet":
        return [python, "-m", "kvfleet.engine.cli", "serve", *common, "--disable-log-requests",
                "--log-level", "warning"]
    if engine == "vllm":
        from kvfleet.engine.bench.vllm_backend import has_tokenizer

        extra = [] if has_tokenizer(model) else ["--skip-tokenizer-init"]
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", *common, *extra,
                "--uvicorn-log-level", "warning"]
    raise ValueError(f"engine: 'kvfleet' or 'vllm', got {engine!r}")


def health_ok(base_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def scrape_histograms(base_url: str) -> dict[str, tuple[float, float]]:
    """{histogram name without its prefix: (sum, count)} of the server's *_seconds histograms (kvfleet: and
    vllm: name theirs alike: time_to_first_token, inter_token_latency, request_queue_time, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram" or not fam.name.endswith("_seconds"):
            continue
        short = fam.name.split(":", 1)[-1]
        acc = out.setdefault(short, [0.0, 0.0])
        for sample in fam.samples:
            if sample.name.endswith("_sum"):
                acc[0] += sample.value
            elif sample.name.endswith("_count"):
                acc[1] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def histogram_means_ms(before: dict[str, tuple[float, float]],
                       after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean of each histogram over what was observed between two scrapes, in ms."""
    means = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c1 > c0:
            means[name] = 1e3 * (s1 - s0) / (c1 - c0)
    return means


def wait_healthy(proc: subprocess.Popen, base_url: str, limit_s: float, poll_s: float = 0.25) -> float | None:
    """Seconds from now until /health answers 200; None if the process exits or the limit passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            return None
        if health_ok(base_url):
            return time.monotonic() - t0
        time.sleep(poll_s)
    return None


def stop_server(proc: subprocess.Popen, grace_s: float = 20.0) -> int | None:
    """SIGTERM to the server's process group (vLLM's engine core is a child process), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # whatever of the group is left (the leader may be gone)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        return None


def run_online(engine: str, model: str, out_dir: Path, loads: Sequence[LoadPoint], port: int, max_model_len: int,
               max_num_seqs: int, max_num_batched_tokens: int, gpu_memory_utilization: float,
               quantization: str | None, label: str | None, health_limit_s: float,
               env: dict[str, str] | None = None, workload: str = ONLINE_WORKLOAD,
               dtype: str = "bfloat16", block_size: int | None = None) -> dict[str, Any]:
    from kvfleet.engine.bench.serve import load_workload, run_benchmark

    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "-".join(x for x in (engine, Path(model).name, quantization, label) if x)
    cmd = server_command(engine, model, port, max_model_len, max_num_seqs, max_num_batched_tokens,
                         gpu_memory_utilization, quantization, dtype=dtype, block_size=block_size)
    base_url = f"http://127.0.0.1:{port}"
    if health_ok(base_url):
        raise RuntimeError(f"port {port}: a server already answers there")
    log_path = out_dir / f"{tag}-server.log"
    startup: dict[str, Any] = {"engine": engine, "model": Path(model).name, "quantization": quantization,
                               "label": label, "command": cmd, "loads": [p.__dict__ for p in loads]}
    print(f"starting {engine}: {' '.join(cmd)}", flush=True)
    with log_path.open("w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            healthy = wait_healthy(proc, base_url, health_limit_s)
            startup["time_to_healthy_s"] = healthy
            print(f"{engine}: healthy after {healthy if healthy is None else round(healthy, 1)} s", flush=True)
            if healthy is None:
                startup["error"] = f"not healthy within {health_limit_s} s (exit code {proc.poll()})"
            else:
                for p in loads:
                    reqs = load_workload(workload, p.num_prompts, p.seed)
                    before = scrape_histograms(base_url)
                    t = time.monotonic()
                    res = asyncio.run(run_benchmark(base_url, None, reqs, p.rate, None, p.seed, None, 600.0))
                    res.update(engine=engine, model_dir=Path(model).name, quantization=quantization, label=label,
                               load_point=p.name, workload=Path(workload).stem, wall_s=time.monotonic() - t,
                               # the server's own view (its histograms between two scrapes): client minus
                               # server TTFT is the HTTP path, server TTFT minus queue time the prefill
                               server_means_ms=histogram_means_ms(before, scrape_histograms(base_url)))
                    (out_dir / f"{tag}-online-{p.name}.json").write_text(json.dumps(res, indent=1) + "\n")
                    print(f"{engine} {p.name}: {res['completed']}/{len(reqs)} ok, TTFT p50 "
                          f"{res['ttft_ms']['p50']:.1f} p99 {res['ttft_ms']['p99']:.1f} ms, TPOT p50 "
                          f"{res['tpot_ms']['p50']:.2f} ms, {res['output_throughput']:.0f} out tok/s", flush=True)
        finally:
            startup["exit_code"] = stop_server(proc)
            startup["total_s"] = time.monotonic() - t0
    (out_dir / f"{tag}-startup.json").write_text(json.dumps(startup, indent=1) + "\n")
    return startup


# --- summary -------------------------------------------------------------------------------------
def load_results(folders: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(offline records, online records, startup records) of every JSON file in the folders."""
    offline, online, startup = [], [], []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if not isinstance(rec, dict):
                continue
            if "output_tokens_per_s" in rec and "backend" in rec:
                offline.append(rec)
            elif "load_point" in rec and "ttft_ms" in rec:
                online.append(rec)
            elif "time_to_healthy_s" in rec:
                startup.append(rec)
    return offline, online, startup


ONLINE_CELLS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("e2el_ms", "p50"))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def summary_lines(offline: list[dict[str, Any]], online: list[dict[str, Any]],
                  startup: list[dict[str, Any]]) -> list[str]:
    lines = ["| row | kvfleet | vLLM | kvfleet / vLLM |", "| --- | --- | --- | --- |"]
    by_key: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in offline:
        key = (r["model"], r["workload"], r.get("quantization"), r.get("label") if r["backend"] == "kvfleet" else None)
        by_key.setdefault(key, {})[r["backend"]] = r
    vllm_of = {(k[0], k[1], k[2]): v["vllm"] for k, v in by_key.items() if "vllm" in v}
    for (model, workload, quant, label), recs in sorted(by_key.items(), key=lambda kv: tuple(map(str, kv[0]))):
        kv = recs.get("kvfleet")
        if kv is None:
            continue
        vl = vllm_of.get((model, workload, quant))
        name = f"{model} {workload}" + (f" {quant}" if quant else "") + (f" [{label}]" if label else "")
        a, b = kv["output_tokens_per_s"], vl["output_tokens_per_s"] if vl else None
        bad = "" if not kv.get("requests_with_wrong_length") else f" ({kv['requests_with_wrong_length']} short!)"
        lines.append(f"| {name}, output tok/s | {a:,.0f}{bad} | {b:,.0f} | {_ratio(a, b)} |" if b else
                     f"| {name}, output tok/s | {a:,.0f}{bad} | - | - |")
    # online: vLLM's latency / ours (> 1: kvfleet faster). E2E beside TPOT: when every request ends
    # together (a burst), TPOT = (E2E - TTFT) / (tokens - 1), so an earlier first token alone raises it.
    on: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in online:
        on.setdefault((r.get("model_dir"), r.get("quantization"), r["load_point"], r.get("label")
                       if r["engine"] == "kvfleet" else None), {})[r["engine"]] = r
    vl_on = {(k[0], k[1], k[2]): v["vllm"] for k, v in on.items() if "vllm" in v}
    if on:
        lines += ["", "| online load point | TTFT p50 ms (ours / vLLM) | TTFT p99 ms | TPOT p50 ms | E2E p50 ms | "
                      "vLLM's / ours: TTFT p50, TTFT p99, TPOT p50, E2E p50 | failed |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for (model, quant, point, label), recs in sorted(on.items(), key=lambda kv: tuple(map(str, kv[0]))):
            kv = recs.get("kvfleet")
            if kv is None:
                continue
            vl = vl_on.get((model, quant, point))

            def f(r: dict[str, Any] | None, metric: str, q: str) -> float | None:
                return r[metric][q] if r and r.get(metric) else None

            cells = []
            for metric, q in ONLINE_CELLS:
                a, b = f(kv, metric, q), f(vl, metric, q)
                cells.append(f"{a:.1f} / {b:.1f}" if a is not None and b is not None else
                             (f"{a:.1f} / -" if a is not None else "-"))
            ratios = ", ".join(_ratio(f(vl, m, q), f(kv, m, q)) for m, q in ONLINE_CELLS)
            name = f"{model} {point}" + (f" {quant}" if quant else "") + (f" [{label}]" if label else "")
            failed = f"{kv.get('failed', 0)} / {vl.get('failed', 0) if vl else '-'}"
            lines.append(f"| {name} | {' | '.join(cells)} | {ratios} | {failed} |")
    if online:
        lines += ["", "| load point | engine | client TTFT mean ms | server TTFT mean | server queue time mean | "
                      "client TPOT mean | server ITL mean |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(online, key=lambda r: (str(r.get("model_dir")), r["load_point"], r["engine"],
                                               str(r.get("label")))):
            sm = r.get("server_means_ms") or {}

            def cell(v: float | None) -> str:
                return f"{v:.1f}" if v is not None else "-"

            name = r["load_point"] + (f" [{r['label']}]" if r.get("label") else "")
            lines.append(f"| {name} | {r['engine']} | {cell((r.get('ttft_ms') or {}).get('mean'))} | "
                         f"{cell(sm.get('time_to_first_token_seconds'))} | {cell(sm.get('request_queue_time_seconds'))}"
                         f" | {cell((r.get('tpot_ms') or {}).get('mean'))} | "
                         f"{cell(sm.get('inter_token_latency_seconds'))} |")
    if startup:
        lines += ["", "| server start to healthy | seconds |", "| --- | --- |"]
        for s in sorted(startup, key=lambda s: (s["engine"], str(s.get("quantization")), str(s.get("label")))):
            t = s.get("time_to_healthy_s")
            name = " ".join(str(x) for x in (s["engine"], s.get("model"), s.get("quantization"), s.get("label")) if x)
            lines.append(f"| {name} | {t:.1f} |" if t is not None else f"| {name} | {s.get('error', 'failed')} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfleet.engine.bench.compare", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("online", help="one server, every load point")
    o.add_argument("--engine", required=True, choices=["kvfleet", "vllm"])
    o.add_argument("--model", required=True)
    o.add_argument("--out-dir", required=True, type=Path)
    o.add_argument("--loads", default=DEFAULT_LOADS, help="name:rate:requests,... (rate inf = all at once)")
    o.add_argument("--port", type=int, default=8000)
    o.add_argument("--max-model-len", type=int, default=4096)
    o.add_argument("--max-num-seqs", type=int, default=1024)
    o.add_argument("--max-num-batched-tokens", type=int, default=8192)   # vLLM's online default on an H200
    o.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    o.add_argument("--quantization", default=None, choices=["fp8"])
    o.add_argument("--block-size", type=int, default=None, help="KV cache block size (default: the server's)")
    o.add_argument("--label", default=None, help="tags kvfleet runs of another setting (e.g. nowarmup)")
    o.add_argument("--health-limit-s", type=float, default=240.0)
    o.add_argument("--workload", default=ONLINE_WORKLOAD, help="a workload name or JSONL file (CPU tests)")
    o.add_argument("--dtype", default="bfloat16")
    s = sub.add_parser("summary", help="the comparison table of result folders")
    s.add_argument("folders", nargs="+", type=Path)
    s.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.cmd == "online":
        try:
            loads = parse_loads(args.loads)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        res = run_online(args.engine, args.model, args.out_dir, loads, args.port, args.max_model_len,
                         args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization,
                         args.quantization, args.label, args.health_limit_s, workload=args.workload,
                         dtype=args.dtype, block_size=args.block_size)
        return 0 if res.get("time_to_healthy_s") is not None else 1
    lines = summary_lines(*load_results(args.folders))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
