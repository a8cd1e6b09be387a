"""Starting, probing and stopping the cluster's processes (the I/O edge of the cluster scripts).

Each process runs in its own session (it outlives the command that started it), logs to `.cluster/logs/NAME.log`
and is recorded in `.cluster/run/NAME.pid` with the program path it was started as, so that stopping it can check
the pid still belongs to that program before signalling it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """An HTTP(S) health endpoint; client certificate and CA are optional."""

    url: str
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def ok(self, timeout: float = 2.0) -> bool:
        """True when the endpoint answers 200."""
        context = None
        if self.url.startswith("https://"):
            context = ssl.create_default_context(cafile=str(self.ca)) if self.ca else ssl._create_unverified_context()
            if self.cert and self.key:
                context.load_cert_chain(str(self.cert), str(self.key))
        try:
            with urllib.request.urlopen(self.url, timeout=timeout, context=context) as response:  # noqa: S310
                return response.status == 200
        except (urllib.error.URLError, OSError, ssl.SSLError):
            return False


@dataclass(frozen=True)
class Component:
    """One process of the cluster: its name, command line and health probe."""

    name: str
    argv: tuple[str, ...]
    probe: Probe
    env: tuple[tuple[str, str], ...] = ()  # added to (or replacing) this process's environment


def _pidfile(run: Path, name: str) -> Path:
    return run / f"{name}.pid"


def _argv0_of(pid: int) -> str | None:
    """The program path a live process was started as (None for a gone or zombie process)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode(errors="replace") if raw else None


def _cmdline_of(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]] if raw else None


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists and has not exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[-1].split()[0] != b"Z"


def running_pid(run: Path, name: str) -> int | None:
    """The pid of our process NAME when it is alive and still runs the program it was started as.

    Compared by command line (argv[0] is the link in .cluster/bin), not by the resolved executable, so that
    rebuilding or moving the cached binaries does not disown running processes; the whole command line, because
    for the engine kubelet argv[0] is only the virtualenv's `python`.
    """
    try:
        record = json.loads(_pidfile(run, name).read_text())
    except (OSError, ValueError):
        return None
    pid, argv0, argv = record.get("pid"), record.get("argv0"), record.get("argv")
    if not isinstance(pid, int) or not argv0:
        return None
    if argv:  # the whole command line: argv[0] alone is just `python` for the engine kubelet
        return pid if _cmdline_of(pid) == list(argv) else None
    return pid if _argv0_of(pid) == argv0 else None


def start(component: Component, run: Path, logs: Path) -> int:
    """Starts a component in its own session, logging to logs/NAME.log; returns its pid."""
    exe = Path(component.argv[0])
    already = running_pid(run, component.name)
    if already is not None:
        raise RuntimeError(f"{component.name} already runs (pid {already}); stop the cluster first")
    if not exe.exists():
        raise FileNotFoundError(f"{component.name}: {exe} is missing; run `make cluster-build` first")
    run.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{component.name}.log", "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(component.argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(  # noqa: S603
            component.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=run, start_new_session=True, env={**os.environ, **dict(component.env)} if component.env else None,
        )  # fmt: skip
    record = {"pid": proc.pid, "argv0": component.argv[0], "exe": str(exe.resolve()), "argv": list(component.argv)}
    _pidfile(run, component.name).write_text(json.dumps(record))
    log.info("started %s (pid %d)", component.name, proc.pid)
    return proc.pid


def wait_until(what: str, check: Callable[[], bool], timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Polls `check` until it is true; fails early when `alive` turns false, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        if check():
            return
        if not alive():
            raise RuntimeError(f"{what}: the process exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def wait_ready(component: Component, run: Path, logs: Path, timeout: float = 180.0) -> None:
    """Waits until our process answers its probe; shows the log's tail when it does not."""
    pid = _recorded_pid(run, component.name)
    # By pid, not running_pid(): right after exec /proc/PID/cmdline may not show the new program yet.
    alive = lambda: pid is not None and pid_alive(pid)  # noqa: E731
    try:
        # Alive first: a process that lost a port race exits, while another one may answer the probe.
        wait_until(component.name, lambda: alive() and component.probe.ok(), timeout, alive)
    except (RuntimeError, TimeoutError) as err:
        tail = "".join((logs / f"{component.name}.log").read_text(errors="replace").splitlines(True)[-25:])
        raise RuntimeError(f"{err}; last lines of {logs / (component.name + '.log')}:\n{tail}") from err


def _recorded_pid(run: Path, name: str) -> int | None:
    try:
        pid = json.loads(_pidfile(run, name).read_text()).get("pid")
    except (OSError, ValueError):
        return None
    return pid if isinstance(pid, int) else None


def start_and_wait(component: Component, run: Path, logs: Path, timeout: float = 180.0) -> None:
    """Starts a component and waits until its probe answers."""
    start(component, run, logs)
    wait_ready(component, run, logs, timeout)


def stop(run: Path, name: str, grace: float = 10.0) -> bool:
    """Stops our process NAME (SIGTERM, then SIGKILL after `grace` s); True when one was running."""
    pid = running_pid(run, name)
    _pidfile(run, name).unlink(missing_ok=True)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _argv0_of(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if _argv0_of(pid) is not None:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pid)
    log.info("stopped %s (pid %d)", name, pid)
    return True


def _reap(pid: int) -> None:
    """Collects the exit status when we are the parent (a fixture that started the cluster), so no zombie stays."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_all(run: Path, names: Sequence[str]) -> list[str]:
    """Stops the named processes in order; returns those that were running."""
    return [name for name in names if stop(run, name)]
