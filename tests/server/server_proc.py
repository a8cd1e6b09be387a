"""Run a real `kvfleet serve` subprocess on 127.0.0.1 (free port) and read its /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

KEYS = {"sk-alpha-0123456789": "alpha", "sk-beta-9876543210": "beta"}
ALPHA, BETA = list(KEYS)


def kvfleet_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("kvfleet")  # the installed entry point, as users run it
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "kvfleet.engine.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    model: str
    # /health answers seen while starting, in order: (status, error code or "ok"), repeats collapsed.
    startup_health: list[tuple[int, str]] = field(default_factory=list)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} from /metrics, via prometheus-client's parser."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        return sum(v for (n, lab), v in self.metrics().items()
                   if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(model_dir: Path, log_dir: Path, *extra: str, ready_timeout: float = 300) -> Server:
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [*kvfleet_cmd(), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--served-model-name", "tiny", *extra]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log, "tiny")
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvfleet serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            resp = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            pass
        else:
            seen = (resp.status_code, "ok" if resp.status_code == 200 else resp.json()["error"]["code"])
            if not server.startup_health or server.startup_health[-1] != seen:
                server.startup_health.append(seen)
            if resp.status_code == 200:
                return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"kvfleet serve not healthy after {ready_timeout}s:\n{server.log_tail()}")
