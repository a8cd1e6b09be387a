"""`python -m localcluster.enginekubelet ...`: the engine kubelet process (started by `cluster.py up`).

Serves `GET /healthz` (200 once the pod list is synced and the loop turns) and `GET /engines` (JSON: one row per
engine pod, with its IP, port, pid, model, state, readiness and restarts) on 127.0.0.1:--port.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from . import models, processes
from .api import ApiServer
from .pods import EngineOptions
from .supervisor import Settings, Supervisor, watch_pods

log = logging.getLogger("engine-kubelet")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine-kubelet", description=__doc__)
    p.add_argument("--apiserver", required=True, help="https://127.0.0.1:PORT")
    p.add_argument("--ca", required=True, type=Path)
    p.add_argument("--cert", required=True, type=Path, help="client certificate (user kvfleet:engine-kubelet)")
    p.add_argument("--key", required=True, type=Path)
    p.add_argument("--port", required=True, type=int, help="status port on 127.0.0.1")
    p.add_argument("--records", required=True, type=Path, help="folder of the engine process records")
    p.add_argument("--logs", required=True, type=Path, help="folder of the engines' logs")
    p.add_argument("--volumes", required=True, type=Path, help="folder where Secret volumes are written")
    p.add_argument("--model", default=models.EMBEDDED,
                   help="default local model: embedded, tiny, tiny-<arch> or an absolute path")
    p.add_argument("--model-cache", required=True, type=Path, help="where tiny models are built")
    p.add_argument("--python", default=sys.executable, help="the Python that runs `kvfleet serve`")
    p.add_argument("--max-num-seqs", type=int, default=4, help="--max-num-seqs when a pod sets none")
    p.add_argument("--max-grace", type=float, default=15.0, help="longest drain after SIGTERM before SIGKILL (s)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    return p.parse_args(argv)


class Status(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, supervisor: Supervisor, watcher: threading.Thread) -> None:
        self.supervisor, self.watcher = supervisor, watcher
        super().__init__(("127.0.0.1", port), StatusHandler)

    def healthy(self) -> bool:
        s = self.supervisor
        return s.synced.is_set() and self.watcher.is_alive() and time.monotonic() - s.last_tick < 10


class StatusHandler(BaseHTTPRequestHandler):
    server: Status

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/healthz":
            ok = self.server.healthy()
            self._send(200 if ok else 503, {"status": "ok" if ok else "not ready"})
        elif self.path == "/engines":
            self._send(200, {"engines": self.server.supervisor.snapshot()})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        pass  # quiet: the cluster polls /healthz


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call is noise
    models.check_choice(args.model)
    leftovers = processes.kill_recorded(args.records)  # engines of an engine kubelet that did not stop cleanly
    if leftovers:
        log.warning("stopped %d engine(s) left by an earlier run: %s", len(leftovers),
                    ", ".join(f"{r.namespace}/{r.pod} (pid {r.pid})" for r in leftovers))  # fmt: skip
    cluster_dir = str(Path(__file__).resolve().parents[2])
    child_env = {**os.environ, "PYTHONPATH": cluster_dir, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    catalog = models.ModelCatalog(args.python, args.model_cache, child_env)
    settings = Settings(records=args.records, logs=args.logs, volumes=args.volumes, default_model=args.model,
                        options=EngineOptions(python=args.python, max_num_seqs=args.max_num_seqs),
                        max_grace_s=args.max_grace)  # fmt: skip
    # Two clients: the watch holds one connection open for minutes.
    supervisor = Supervisor(ApiServer(args.apiserver, args.ca, args.cert, args.key), catalog, settings)
    stop = threading.Event()
    watch_api = ApiServer(args.apiserver, args.ca, args.cert, args.key)
    watcher = threading.Thread(target=watch_pods, args=(watch_api, supervisor.inbox, stop), name="pod-watch",
                               daemon=True)  # fmt: skip
    status = Status(args.port, supervisor, watcher)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stopping every engine, then exiting", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watcher.start()
    threading.Thread(target=status.serve_forever, name="status", daemon=True).start()
    log.info("engine kubelet up: default model %s, status on 127.0.0.1:%d", args.model, args.port)
    try:
        supervisor.run(stop)  # on this (the main) thread: engines die with it (launch.py)
    finally:
        status.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
