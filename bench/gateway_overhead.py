"""The gateway's own cost: latency it adds per request and the requests/s it sustains, against a fast upstream.

A fast OpenAI-shaped upstream (`python -m kvfleet.gateway.testing upstream`, answers at once) runs as its own
process; the gateway (`kvfleet gateway --config`, one tenant, the upstream as the model's one replica) as
another. The client (aiohttp, one process) measures, in one run, side by side:

- latency: sequential requests (one in flight), direct to the upstream and through the gateway, alternating
  in blocks so drift on a shared machine hits both; p50/p90/p99 and the added p50 (gateway - direct);
- throughput: a closed loop of `--concurrency` requests in flight for `--seconds`, direct and through the
  gateway: requests/s (the client, the upstream and the gateway share the machine's cores), and the gateway
  process's own CPU time per request (from /proc: robust to what else runs on a shared machine).

Non-streamed completions and streamed ones (3 token events, usage asked for by the gateway and dropped).

    .venv/bin/python bench/gateway_overhead.py --label v1    # -> bench/results/gateway/overhead-v1.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from kvfleet.gateway.testing import GatewayProcess, free_port, wait_until

from provenance import git_describe

KEY = "bench-key-0123456789abcdef"
RESULTS = Path(__file__).resolve().parent / "results" / "gateway"


def pct(values: list[float], q: float) -> float:
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50) * 1000, "p90": pct(values, 90) * 1000, "p99": pct(values, 99) * 1000,
            "mean": statistics.fmean(values) * 1000, "n": len(values)}


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - start


async def latency(direct: str, gateway: str, body: dict[str, Any], n: int, block: int = 50) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {KEY}"}
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with aiohttp.ClientSession() as session:
        for url, hdr in ((direct, {}), (gateway, auth)):  # warm both paths (connections, code)
            for _ in range(20):
                await one(session, url, body, hdr)
        for _ in range(n // block):
            for name, url, hdr in (("direct", direct, {}), ("gateway", gateway, auth)):
                for _ in range(block):
                    times[name].append(await one(session, url, body, hdr))
    out = {name: summary_ms(vals) for name, vals in times.items()}
    out["added_p50_ms"] = out["gateway"]["p50"] - out["direct"]["p50"]
    return out


async def throughput(url: str, body: dict[str, Any], headers: dict[str, str], concurrency: int,
                     seconds: float) -> dict[str, float]:
    done = 0
    stop = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await one(session, url, body, headers)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"requests": done, "seconds": elapsed, "requests_per_s": done / elapsed}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc): what it costs, whatever else the machine runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_upstream(tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet.gateway.testing", "upstream", "--port", str(port),  # noqa: S603
                             "--tokens", str(tokens)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/metrics", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until("fast upstream", up, timeout=30)
    return proc, url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="local")
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    upstream, up_url = start_upstream(tokens=3)
    tmp = Path(tempfile.mkdtemp(prefix="gw-overhead-"))
    config = tmp / "gateway.yaml"
    config.write_text(yaml.safe_dump({"tenants": {"bench": {"keys": [KEY], "models": {"fast": {
        "replicas": [up_url]}}}}}))
    gw = GatewayProcess(tmp / "gateway.log", config=config, args=["--log-level", "warning"]).start()
    try:
        results: dict[str, Any] = {}
        for kind, body in (("completion", {"model": "fast", "prompt": "hello", "max_tokens": 1}),
                           ("stream", {"model": "fast", "prompt": "hello", "max_tokens": 3, "stream": True})):
            lat = asyncio.run(latency(up_url, gw.url, body, args.requests))
            tput_direct = asyncio.run(throughput(up_url, body, {}, args.concurrency, args.seconds))
            assert gw.proc is not None
            cpu_before = cpu_seconds(gw.proc.pid)
            tput_gw = asyncio.run(throughput(gw.url, body, {"Authorization": f"Bearer {KEY}"}, args.concurrency,
                                             args.seconds))
            cpu = cpu_seconds(gw.proc.pid) - cpu_before
            tput_gw["gateway_cpu_s"] = cpu
            tput_gw["gateway_cpu_ms_per_request"] = cpu / tput_gw["requests"] * 1000
            tput_gw["requests_per_core_s"] = tput_gw["requests"] / cpu if cpu else 0.0
            results[kind] = {"latency_ms": lat, "throughput_direct": tput_direct, "throughput_gateway": tput_gw}
            print(f"{kind}: added p50 {lat['added_p50_ms']:.3f} ms (direct {lat['direct']['p50']:.3f}, gateway "
                  f"{lat['gateway']['p50']:.3f}); {tput_gw['requests_per_s']:.0f} req/s through the gateway, "
                  f"{tput_direct['requests_per_s']:.0f} direct; gateway CPU "
                  f"{tput_gw['gateway_cpu_ms_per_request']:.3f} ms/request", flush=True)
    finally:
        gw.stop()
        upstream.terminate()
        upstream.wait(10)
    out = {"label": args.label, "git": git_describe(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "machine": platform.machine(), "concurrency": args.concurrency, "seconds": args.seconds,
           "note": "client, upstream and gateway share this machine's cores; other work on it adds noise",
           "results": results}
    path = args.out or RESULTS / f"overhead-{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
