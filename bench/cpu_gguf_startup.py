"""Start to healthy of `kvfleet serve` on the embedded GGUF model (CPU), for two source trees side by side.

What a replica woken from zero on CPU pays before its first token (the demo's "first token N s after the
request"). Each tree's `engine/` goes first on PYTHONPATH, so one virtualenv runs both; runs alternate
between the trees (A B A B ...) so that load on the machine falls on both alike. Phase times come from the
server's log lines (process start, "serving", "loaded", "model ready").

    git worktree add /tmp/kvf-before <rev>
    .venv/bin/python bench/cpu_gguf_startup.py --tree before=/tmp/kvf-before --tree after=. --runs 3
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


def start_once(tree: Path, model: str, limit_s: float) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "engine"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "kvfleet.engine.cli", "serve", model, "--device", "cpu", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "8"]
    wall0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            text=True)
    healthy = wait_healthy(proc, f"http://127.0.0.1:{port}", limit_s)
    stop_server(proc)
    log = proc.stdout.read() if proc.stdout else ""
    if healthy is None:
        raise RuntimeError(f"{tree}: not healthy within {limit_s} s:\n{log[-2000:]}")
    return {"time_to_healthy_s": round(healthy, 2), **_phase_times(log, wall0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (twice or more)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--limit-s", type=float, default=300.0)
    ap.add_argument("--label", default="side-by-side")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    model = str(find_default_model())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, path in trees.items():
            r = start_once(Path(path).resolve(), model, args.limit_s)
            runs[name].append(r)
            print(f"run {i + 1} {name}: healthy after {r['time_to_healthy_s']} s {r}", flush=True)
    summary = {name: {"median_time_to_healthy_s": statistics.median(r["time_to_healthy_s"] for r in rs)}
               for name, rs in runs.items()}
    for name, path in trees.items():
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        summary[name]["tree"] = path
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
