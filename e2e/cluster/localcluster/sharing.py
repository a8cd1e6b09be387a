"""Sharing one checkout's cluster between processes: a lock around up/down, and a register of the test sessions
that use it, so that the last one out (if a session started the cluster) stops it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .layout import Layout


@contextlib.contextmanager
def locked(layout: Layout, timeout: float = 600.0) -> Iterator[None]:
    """Serialises up/down between processes sharing one checkout (several test sessions at once)."""
    layout.state.mkdir(parents=True, exist_ok=True)
    with open(layout.state / "lock", "w") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process holds {layout.state / 'lock'} for {timeout:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _users_dir(layout: Layout) -> Path:
    return layout.run / "users"


def add_user(layout: Layout, pid: int | None = None) -> None:
    """Records that process `pid` (default: this one) uses the cluster; see `release_user`."""
    _users_dir(layout).mkdir(parents=True, exist_ok=True)
    (_users_dir(layout) / str(pid or os.getpid())).touch()


def release_user(layout: Layout, pid: int | None = None) -> bool:
    """Forgets process `pid`; True when no other live process still uses the cluster."""
    users = _users_dir(layout)
    (users / str(pid or os.getpid())).unlink(missing_ok=True)
    if not users.exists():
        return True
    return not [p for p in users.glob("*") if p.name.isdigit() and Path(f"/proc/{p.name}").exists()]
