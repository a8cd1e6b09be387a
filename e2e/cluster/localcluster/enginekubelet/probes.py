"""Startup, readiness and liveness over the engine's `/health`, as a kubelet runs the pod's probes.

`ProbeTracker` decides (pure: results and times in, a verdict out); `Prober` is the thread that asks `/health` when
the tracker says a probe is due and reports each new verdict. One deliberate difference from a kubelet: until the
engine first answers, `/health` is asked every `fast_period_s` (1 s) rather than every startup `periodSeconds`
(10 s for the operator's pods), so a pod turns Ready within a second of its engine; the failure windows (how long
an engine may load, how long it may fail before it is unready or restarted) are the pod's own.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .pods import ProbeSpec


@dataclass(frozen=True)
class Verdict:
    started: bool  # the startup probe passed (the engine answered once)
    ready: bool
    restart: str | None = None  # why the container must be restarted (startup or liveness failed), if it must


class ProbeTracker:
    """The probes of one run of the engine, started at `began` (monotonic seconds)."""

    def __init__(self, startup: ProbeSpec | None, readiness: ProbeSpec | None, liveness: ProbeSpec | None,
                 began: float, fast_period_s: float = 1.0) -> None:  # fmt: skip
        self.readiness, self.liveness = readiness, liveness
        self.fast_period_s = fast_period_s
        first = startup or liveness
        # How long the engine may take to answer at all before it is restarted (None: as long as it takes).
        self.startup_deadline = (began + first.initial_delay_s + first.failure_threshold * first.period_s
                                 if first else None)  # fmt: skip
        self.next_startup = began + (startup.initial_delay_s if startup else 0.0)
        self.next_readiness = self.next_liveness = 0.0
        self.started = self.ready = False
        self.readiness_fails = self.readiness_oks = self.liveness_fails = 0

    def next_due(self) -> float:
        if not self.started:
            return self.next_startup
        due = [t for t, spec in ((self.next_readiness, self.readiness), (self.next_liveness, self.liveness)) if spec]
        return min(due) if due else float("inf")

    def timeout_s(self) -> float:
        specs = [s for s in (self.readiness, self.liveness) if s]
        return max([s.timeout_s for s in specs], default=1.0)

    def observe(self, ok: bool, now: float) -> Verdict:
        """Applies one `/health` result, taken at `now`, to every probe that was due."""
        if not self.started:
            if ok:
                self.started = self.ready = True
                self.next_readiness = now + (self.readiness.period_s if self.readiness else 0.0)
                self.next_liveness = now + (self.liveness.period_s if self.liveness else 0.0)
                return Verdict(True, True)
            self.next_startup = now + self.fast_period_s
            if self.startup_deadline is not None and now >= self.startup_deadline:
                return Verdict(False, False, "the engine did not answer /health within the startup probe's window")
            return Verdict(False, False)
        restart = None
        if self.readiness and now >= self.next_readiness:
            self.next_readiness = now + self.readiness.period_s
            if ok:
                self.readiness_fails, self.readiness_oks = 0, self.readiness_oks + 1
                if self.readiness_oks >= self.readiness.success_threshold:
                    self.ready = True
            else:
                self.readiness_oks, self.readiness_fails = 0, self.readiness_fails + 1
                if self.readiness_fails >= self.readiness.failure_threshold:
                    self.ready = False
        if self.liveness and now >= self.next_liveness:
            self.next_liveness = now + self.liveness.period_s
            self.liveness_fails = 0 if ok else self.liveness_fails + 1
            if self.liveness_fails >= self.liveness.failure_threshold:
                restart = f"liveness probe failed {self.liveness_fails} times in a row"
        return Verdict(True, self.ready, restart)


def health_ok(host: str, port: int, timeout_s: float) -> bool:
    """GET /health answers 200 (plain http.client: never through a proxy from the environment)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


@dataclass(frozen=True)
class ProbeReport:
    uid: str
    run: int  # which run of the engine (a report about an earlier run is stale)
    verdict: Verdict


class Prober(threading.Thread):
    """Probes one run of an engine until stopped or a restart is due; reports each change of verdict."""

    def __init__(self, uid: str, run: int, host: str, port: int, tracker: ProbeTracker,
                 report: Callable[[ProbeReport], None]) -> None:  # fmt: skip
        super().__init__(name=f"probe-{uid[:8]}-{run}", daemon=True)
        self.uid, self.run_number, self.host, self.port = uid, run, host, port
        self.tracker, self.report = tracker, report
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        last: Verdict | None = None
        while not self.stopped.is_set():
            wait = self.tracker.next_due() - time.monotonic()
            if wait > 0 and self.stopped.wait(min(wait, 5.0)):
                return
            if wait > 0:
                continue
            ok = health_ok(self.host, self.port, self.tracker.timeout_s() if self.tracker.started else 1.0)
            verdict = self.tracker.observe(ok, time.monotonic())
            if verdict != last and not self.stopped.is_set():
                self.report(ProbeReport(self.uid, self.run_number, verdict))
                last = verdict
            if verdict.restart:
                return
