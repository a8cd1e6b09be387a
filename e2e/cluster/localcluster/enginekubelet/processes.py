"""Engine processes: started in their own session, recorded, signalled as a group, never left behind.

Each engine runs in a new session (its pid is its process group) through `launch.py`, which makes the kernel kill it
if the engine kubelet dies. Each is also recorded in `.cluster/run/engines/<namespace>.<pod>.json` (pid and command
line), so `cluster.py down` and a restarted engine kubelet can stop whatever is left, checking first that the pid
still runs that command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER = Path(__file__).resolve().with_name("launch.py")


@dataclass(frozen=True)
class EngineRecord:
    namespace: str
    pod: str
    uid: str
    pid: int
    argv: tuple[str, ...]
    log: str

    @property
    def file_name(self) -> str:
        return f"{self.namespace}.{self.pod}.json"


def cmdline(pid: int) -> tuple[str, ...] | None:
    """The command line of a live process (None when gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1]) if raw else None


def still_runs(record: EngineRecord) -> bool:
    """The recorded pid is alive and runs the recorded engine (not a process that reused the pid)."""
    return cmdline(record.pid) == record.argv


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, header: Sequence[str],
          python: str) -> subprocess.Popen[bytes]:  # fmt: skip
    """Starts an engine in its own session, appending to `log_path` after a header of lines."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        out.write(("\n".join([f"=== {stamp} {' '.join(argv)}", *(f"=== {line}" for line in header)]) + "\n").encode())
        out.flush()
        return subprocess.Popen(  # noqa: S603
            [python, str(LAUNCHER), str(os.getpid()), "--", *argv], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, env=dict(env), cwd=str(log_path.parent), start_new_session=True,
        )  # fmt: skip


def write_record(folder: Path, record: EngineRecord) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (record.file_name + ".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(folder / record.file_name)


def remove_record(folder: Path, record: EngineRecord) -> None:
    (folder / record.file_name).unlink(missing_ok=True)


def read_records(folder: Path) -> list[EngineRecord]:
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            out.append(EngineRecord(**{**data, "argv": tuple(data["argv"])}))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    return out


def signal_group(pgid: int, sig: int) -> None:
    """Signals every process of the engine's group (its pid is the group's id); a gone group is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_leader(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_recorded(folder: Path, grace_s: float = 5.0) -> list[EngineRecord]:
    """Stops every recorded engine that still runs (SIGTERM, SIGKILL after `grace_s`) and forgets all records;
    returns those that were running."""
    records = [r for r in read_records(folder) if still_runs(r)]
    for record in records:
        signal_leader(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(still_runs(r) for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
    for record in records:
        signal_group(record.pid, signal.SIGKILL)
    for path in folder.glob("*.json"):
        path.unlink(missing_ok=True)
    return records
