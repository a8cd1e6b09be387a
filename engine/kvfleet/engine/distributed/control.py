"""The driver's control messages to its tensor-parallel workers: one pipe per worker.

A message (a small picklable tuple, see worker.py) is pickled once and written to every
worker's pipe; the driver never waits for a reply. This replaced broadcasting each message
over a gloo group (two gloo collectives per message, a size and a payload, with the worker's
receive on the critical path of every step). A worker whose driver is gone reads end-of-file and
leaves.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any


class WorkerGone(RuntimeError):
    """A worker's end of the pipe is closed: it died."""


class ControlSender:
    """The driver's ends (one writable connection per worker, rank order)."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns

    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise WorkerGone(f"tensor parallel worker rank {rank} is gone ({exc})") from None

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def receive(conn: Connection) -> tuple[Any, ...]:
    """The next message for this worker; ("shutdown",) when the driver's end is closed."""
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, ConnectionResetError, OSError):
        return ("shutdown",)
