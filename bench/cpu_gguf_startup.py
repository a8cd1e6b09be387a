"""Start to first token of `kvfleet serve` on the embedded GGUF model (CPU), for two source trees or settings side
by side.

What a replica woken from zero on CPU pays before its first token (the demo's "first token N s after the
request"): start to healthy, then its first request (a sampled, streamed chat completion) to its first token. Each
tree's `engine/` goes first on PYTHONPATH, so one virtualenv runs both; runs alternate between the trees (A B A B
...) so that load on the machine falls on both alike. Phase times come from the server's log lines (process start,
"serving", "loaded", "model ready").

    git worktree add /tmp/kvf-before <rev>
    .venv/bin/python bench/cpu_gguf_startup.py --tree before=/tmp/kvf-before --tree after=. --runs 3
    .venv/bin/python bench/cpu_gguf_startup.py --tree plan=.,KVFLEET_WARMUP=1 --tree step=.,KVFLEET_WARMUP=0
    # -> bench/results/gguf-startup/<label>.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "engine"))

from kvfleet.engine.bench.compare import stop_server, wait_healthy  # noqa: E402
from kvfleet.engine.tokenizer import find_default_model  # noqa: E402
from kvfleet.gateway.testing import free_port  # noqa: E402

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_PHASES = {"serving": "kvfleet.server serving", "loaded": "model_loader loaded", "ready": "model ready"}


def _phase_times(log: str, t_start: float) -> dict[str, float]:
    """Seconds from the process start to each phase's log line (the log's clock is the wall clock)."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for phase, marker in _PHASES.items():
            if marker in line and phase not in out:
                out[phase] = round(at - t_start, 2)
    return out


FIRST_PROMPT = ("Once upon a time there lived a king in a small city by a river. " * 8).strip()


def first_request(base_url: str, model: str) -> dict[str, float]:
    """A woken replica's first request, as a client sends it (a chat completion, sampled, streamed): seconds to its
    first content token and to its end."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": FIRST_PROMPT}], "max_tokens": 16,
            "temperature": 0.7, "top_p": 0.9, "stream": True}
    t0 = time.monotonic()
    first = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError("the first request streamed no content")
    return {"first_request_ttft_s": round(first, 3), "first_request_s": round(time.monotonic() - t0, 3)}


def start_once(tree: Path, model: str, limit_s: float, extra_env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join([str(tree / "engine"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "kvfleet.engine.cli", "serve", model, "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "8"]
    wall0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            text=True)
    base_url = f"http://127.0.0.1:{port}"
    healthy = wait_healthy(proc, base_url, limit_s)
    first = first_request(base_url, model) if healthy is not None else {}
    stop_server(proc)
    log = proc.stdout.read() if proc.stdout else ""
    if healthy is None:
        raise RuntimeError(f"{tree}: not healthy within {limit_s} s:\n{log[-2000:]}")
    return {"time_to_healthy_s": round(healthy, 2), **first,
            "start_to_first_token_s": round(healthy + first["first_request_ttft_s"], 2), **_phase_times(log, wall0)}


def parse_tree(spec: str) -> tuple[str, Path, dict[str, str]]:
    """NAME=PATH[,VAR=VALUE...] -> (name, tree, environment for its server)."""
    name, rest = spec.split("=", 1)
    path, *settings = rest.split(",")
    return name, Path(path).resolve(), dict(s.split("=", 1) for s in settings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True,
                    help="NAME=PATH[,VAR=VALUE...]: a source tree and its server's environment (twice or more)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit-s", type=float, default=300.0)
    ap.add_argument("--label", default="side-by-side")
    args = ap.parse_args()
    trees = {name: (path, env) for name, path, env in map(parse_tree, args.tree)}
    model = str(find_default_model())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, (path, env) in trees.items():
            r = start_once(path, model, args.limit_s, env)
            runs[name].append(r)
            print(f"run {i + 1} {name}: healthy after {r['time_to_healthy_s']} s {r}", flush=True)
    summary: dict[str, dict[str, Any]] = {
        name: {f"median_{k}": statistics.median(r[k] for r in rs)
               for k in ("time_to_healthy_s", "first_request_ttft_s", "start_to_first_token_s")}
        for name, rs in runs.items()}
    for name, (path, env) in trees.items():
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        summary[name]["tree"] = str(path)
        summary[name]["env"] = env
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--", "engine"], capture_output=True,
                               text=True)
        summary[name]["head"] = rev.stdout.strip()
        summary[name]["engine_dirty"] = bool(dirty.stdout.strip())
    result = {"model": Path(model).name, "device": "cpu", "cpus": os.cpu_count(), "runs": runs, "summary": summary}
    out = REPO / "bench" / "results" / "gguf-startup" / f"{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
