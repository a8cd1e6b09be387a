"""Real `kvfleet serve` processes (CPU, a tiny model) on loopback for the gateway's integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfleet.gateway.testing import free_port, metric_sum, wait_until


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"kvfleet serve exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text, name, **labels)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_engines(model: Path, logs: Path, n: int, *extra: str, served: str = "tiny") -> list[Engine]:
    """`n` engines started at once, returned when all are healthy."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    engines = []
    for _ in range(n):
        port = free_port()
        log = logs / f"engine-{port}.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kvfleet.engine.cli", "serve", str(model),  # noqa: S603
                                     "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                                     "--served-model-name", served, "--log-level", "warning",
                                     "--disable-log-requests", *extra], stdout=fh, stderr=subprocess.STDOUT, env=env)
        engines.append(Engine(proc, f"http://127.0.0.1:{port}", log))
    try:
        for engine in engines:
            wait_until(f"engine {engine.url} healthy", engine.healthy, timeout=180, interval=0.3)
    except BaseException:
        for engine in engines:
            engine.kill()
        raise
    return engines
