"""How long an engine pod may take to stop, from how long the engine drains.

On SIGTERM `kvfleet serve` drains for `--shutdown-grace-period` seconds, then ends what is still running
(503s, error events) and exits. The kubelet kills the container `terminationGracePeriodSeconds` after
SIGTERM, so that must be the engine's grace period plus a margin for the cut-off answers and the exit;
otherwise requests are killed mid-answer. The operator passes the flag explicitly and derives the pod's
period from it; a value in `engine.extraArgs` (or the `KVFLEET_SHUTDOWN_GRACE_PERIOD` env) is honoured.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

GRACE_FLAG = "--shutdown-grace-period"
GRACE_ENV = "KVFLEET_SHUTDOWN_GRACE_PERIOD"
DEFAULT_ENGINE_GRACE_SECONDS = 30.0   # `kvfleet serve`'s own default
TERMINATION_MARGIN_SECONDS = 30       # cut-off answers (<= 5 s), engine and worker exit, a slow node


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None   # the engine refuses it at start; the pod keeps the default period
    return value if math.isfinite(value) and value >= 0 else None


def engine_grace_seconds(extra_args: Sequence[str], env: Sequence[Mapping[str, Any]]) -> float:
    """The drain the engine will use: the last `--shutdown-grace-period` in the extra args (argparse
    keeps the last), else a literal env value, else the engine's default."""
    grace: float | None = None
    for i, arg in enumerate(extra_args):
        if arg == GRACE_FLAG and i + 1 < len(extra_args):
            text: str | None = extra_args[i + 1]
        elif arg.startswith(GRACE_FLAG + "="):
            text = arg.split("=", 1)[1]
        else:
            text = None
        value = _number(text) if text is not None else None
        if value is not None:
            grace = value
    if grace is None:
        literal = [e.get("value") for e in env if e.get("name") == GRACE_ENV and "value" in e]
        grace = _number(str(literal[-1])) if literal else None
    return DEFAULT_ENGINE_GRACE_SECONDS if grace is None else grace


def termination_grace_seconds(engine_grace: float) -> int:
    return math.ceil(engine_grace) + TERMINATION_MARGIN_SECONDS
