"""Structured, quiet logs for kvfleet's processes: `time level logger message key=value ...`.

No dependency beyond the standard library: the engine's server and the gateway (no FastAPI, no torch) share it.
"""

from __future__ import annotations

import logging
import sys

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """`time level logger message key=value ...`: one line per event, extras kept as fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{self.formatTime(record)} {record.levelname} {record.name} {record.getMessage()}"
        extras = {k: v for k, v in vars(record).items() if k not in _STD_ATTRS}
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger("kvfleet")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
