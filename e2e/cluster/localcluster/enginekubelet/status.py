"""Pod status as a kubelet reports it, and its restart back-off (pure: the engine's state in, patches out)."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

# A kubelet's crash-loop back-off: the first restart at once, then 10 s doubling up to 5 min; a container that
# ran for 10 minutes starts over (kubelet: initial 10 s, max 300 s, reset after twice the max).
BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Terminated:
    """How one run of the engine ended."""

    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    message: str = ""

    def as_state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"exitCode": self.exit_code, "reason": self.reason, "startedAt": self.started_at,
                               "finishedAt": self.finished_at}  # fmt: skip
        if self.message:
            out["message"] = self.message
        return {"terminated": out}


def terminated(returncode: int, started_at: str, finished_at: str) -> Terminated:
    """A Popen return code as a container's termination: killed by signal N -> exit code 128+N, as runtimes say."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return Terminated(128 + sig, "Error", started_at, finished_at, f"killed by {name}")
    return Terminated(returncode, "Completed" if returncode == 0 else "Error", started_at, finished_at)


@dataclass(frozen=True)
class ContainerState:
    """What the engine kubelet knows of the engine container; exactly one of waiting/running/terminated."""

    name: str
    image: str
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    waiting: tuple[str, str] | None = ("ContainerCreating", "")  # (reason, message)
    running_since: str | None = None
    terminated: Terminated | None = None
    last: Terminated | None = None
    container_id: str | None = None

    def as_status(self) -> dict[str, Any]:
        if self.running_since is not None:
            state: dict[str, Any] = {"running": {"startedAt": self.running_since}}
        elif self.terminated is not None:
            state = self.terminated.as_state()
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        out: dict[str, Any] = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": self.last.as_state() if self.last else {},
        }
        if self.container_id:
            out["containerID"] = self.container_id
        return out


def _condition(current: Mapping[str, Any], kind: str, ready: bool, now: str, container: str) -> dict[str, Any]:
    """A Ready-like condition; its transition time moves only when its status does."""
    old = next((c for c in current.get("conditions") or [] if c.get("type") == kind), None)
    status = "True" if ready else "False"
    changed = old is None or old.get("status") != status
    out: dict[str, Any] = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),  # type: ignore[union-attr]
        "reason": None if ready else "ContainersNotReady",
        "message": None if ready else f"containers with unready status: [{container}]",
    }
    return out


def status_patch(current: Mapping[str, Any], container: ContainerState, phase: str, now: str) -> dict[str, Any]:
    """A strategic-merge patch of pod status: phase, the Ready and ContainersReady conditions (merged by type,
    leaving PodScheduled/Initialized as they are) and the container's status."""
    return {
        "status": {
            "phase": phase,
            "conditions": [_condition(current, kind, container.ready, now, container.name)
                           for kind in ("ContainersReady", "Ready")],  # fmt: skip
            "containerStatuses": [container.as_status()],
        }
    }


def status_drifted(current: Mapping[str, Any], container: ContainerState, phase: str) -> bool:
    """Whether the pod's status in the API says other than the engine kubelet knows: its phase, or its Ready or
    ContainersReady condition (the node lifecycle controller marks every pod of a node it lost touch with not
    Ready; a kubelet's status manager then writes its own view back)."""
    want = "True" if container.ready else "False"
    conds = {c.get("type"): c.get("status") for c in current.get("conditions") or []}
    return current.get("phase") != phase or any(conds.get(k) != want for k in ("ContainersReady", "Ready"))


def restart_delay(crashes: int) -> float:
    """Seconds before restarting a container that ended `crashes` times in a row (1: at once)."""
    if crashes <= 1:
        return 0.0
    return min(BACKOFF_INITIAL_S * 2 ** (crashes - 2), BACKOFF_MAX_S)


def restarts_after_exit(policy: str, exit_code: int) -> bool:
    """Whether the restart policy restarts a container that ended with `exit_code`."""
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def phase_after_exit(policy: str, exit_code: int) -> str:
    if restarts_after_exit(policy, exit_code):
        return "Running"
    return "Succeeded" if exit_code == 0 else "Failed"
