"""Helpers to run the operator against a real cluster (e2e tests, the demo): install the CRDs,
start/kill the operator as a local process, wait for conditions. Nothing here mocks the cluster."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

REPO = Path(__file__).resolve().parents[3]
CRDS = REPO / "crds"
T = TypeVar("T")


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.5) -> T:
    """Poll `fn` until it returns something truthy; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install_crds(kubectl: Callable[..., Any]) -> None:
    """Apply the CRDs of crds/ (server-side: idempotent) and wait until they are served."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    names = ["modeldeployments.serving.kvfleet.dev", "tenants.serving.kvfleet.dev", "clusterkopfpeerings.kopf.dev"]
    kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names])


class OperatorProcess:
    """`python -m kvfleet.operator` against a kubeconfig, on loopback ports, logging to a file."""

    def __init__(self, kubeconfig: str, log_path: Path, *, peering: str | None = None,
                 identity: str | None = None, env: Mapping[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.peering = peering
        self.identity = identity
        self.extra_env = dict(env or {})
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset: int | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "kvfleet.operator", "--kubeconfig", self.kubeconfig,
                "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
                "--metrics-port", str(self.metrics_port), "--metrics-addr", "127.0.0.1"]
        argv += ["--peering", self.peering] if self.peering else ["--standalone"]
        return argv

    def start(self, wait: bool = True) -> "OperatorProcess":
        # Loopback-only by default: a test or the demo never scrapes a non-loopback address (cluster IPs
        # of the local cluster are not loopback; its pod IPs are).
        env = {**os.environ, "KVFLEET_LOOPBACK_ONLY": "1", **self.extra_env, "KVFLEET_PEERING_LIFETIME": "10"}
        if self.identity:
            env["POD_ID"] = self.identity  # kopf's peering identity survives a restart
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_offset is None:  # restarts append; log_text() covers them all
            self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,  # noqa: S603
                                     cwd=str(REPO), start_new_session=True)
        log.close()
        if wait:
            wait_for("operator liveness endpoint", self.healthy, timeout=60)
        return self

    def healthy(self) -> bool:
        import httpx

        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"operator exited ({self.proc and self.proc.returncode}); see {self.log_path}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        import httpx

        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def kill(self) -> None:
        """SIGKILL: no clean-up, as a crash or an OOM kill would do."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        """What this operator (and its restarts) wrote, not earlier runs sharing the file."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset or 0)
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def condition(obj: Mapping[str, Any] | None, cond_type: str) -> Mapping[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == cond_type:
            return c
    return None


def flavor_objects(suffix: str, flavors: Sequence[str] = ("h200", "l40s"),
                   node_label: str = "kvfleet.dev/gpu-flavor") -> list[dict[str, Any]]:
    """ResourceFlavors named `<flavor>-<suffix>` that select the local cluster's GPU nodes."""
    return [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
             "metadata": {"name": f"{f}-{suffix}"}, "spec": {"nodeLabels": {node_label: f}}} for f in flavors]
