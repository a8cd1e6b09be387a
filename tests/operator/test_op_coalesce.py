"""One pass per key at a time; triggers during a pass fold into one more; failed passes are retried."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import kopf
import pytest

from kvfleet.operator.coalesce import Coalescer
from kvfleet.operator.triggers import Fingerprints, deployment_fingerprint, workload_fingerprint


class Gate:
    """A pass that blocks until released, counting how often it ran."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.runs = 0
        self.concurrent = 0
        self.most_concurrent = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self.runs += 1
            self.concurrent += 1
            self.most_concurrent = max(self.most_concurrent, self.concurrent)
            run = self.runs
        self.entered.set()
        self.release.wait(5)
        with self._lock:
            self.concurrent -= 1
        return run


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def test_triggers_during_a_pass_fold_into_one_more_pass() -> None:
    c, gate = Coalescer(), Gate()
    first, first_out = in_thread(lambda: c.run("k", gate, wait=False))
    assert gate.entered.wait(5)
    # Ten event triggers while it runs: they return at once and ask for one more pass, not ten.
    assert [c.run("k", gate, wait=False) for _ in range(10)] == [None] * 10
    gate.release.set()
    first.join(5)
    assert first_out == [1] and gate.runs == 2 and gate.most_concurrent == 1
    assert c.keys() == 0  # nothing kept once idle


def test_a_waiting_trigger_gets_the_outcome_of_the_pass_that_covers_it() -> None:
    c, gate = Coalescer(), Gate()
    first, _ = in_thread(lambda: c.run("k", gate, wait=True))
    assert gate.entered.wait(5)
    waiter, waiter_out = in_thread(lambda: c.run("k", gate, wait=True))
    time.sleep(0.1)
    gate.release.set()
    first.join(5)
    waiter.join(5)
    assert waiter_out == [2]  # the pass that started after it asked, not the one already running


def test_other_keys_run_at_the_same_time() -> None:
    c, gate = Coalescer(), Gate()
    a, _ = in_thread(lambda: c.run("a", gate, wait=True))
    assert gate.entered.wait(5)
    b, _ = in_thread(lambda: c.run("b", gate, wait=True))
    deadline = time.monotonic() + 5
    while gate.concurrent < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.most_concurrent == 2
    gate.release.set()
    a.join(5)
    b.join(5)


def test_the_highest_rank_pass_runs_next() -> None:
    c, gate = Coalescer(), Gate()
    ran: list[str] = []
    first, _ = in_thread(lambda: c.run("t", gate, wait=False))
    assert gate.entered.wait(5)
    c.run("t", lambda: ran.append("full"), wait=False, rank=1)
    c.run("t", lambda: ran.append("status"), wait=False, rank=0)  # covered by the full pass
    gate.release.set()
    first.join(5)
    assert ran == ["full"]


def test_a_temporary_error_is_retried_after_its_delay_and_raised_to_the_caller() -> None:
    scheduled: list[tuple[float, Callable[[], None]]] = []

    class FakeTimer:
        def __init__(self, delay: float, fn: Callable[[], None]) -> None:
            self.delay, self.fn, self.daemon = delay, fn, False

        def start(self) -> None:
            scheduled.append((self.delay, self.fn))

        def cancel(self) -> None:
            pass

    c = Coalescer(timer=FakeTimer)  # type: ignore[arg-type]
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 2:
            raise kopf.TemporaryError("apiserver away", delay=3)
        return "ok"

    with pytest.raises(kopf.TemporaryError):
        c.run("k", flaky, wait=False)
    assert [d for d, _ in scheduled] == [3]
    scheduled[0][1]()  # the timer fires
    assert len(attempts) == 2 and c.keys() == 0


def test_a_bug_is_raised_not_retried() -> None:
    c = Coalescer()
    with pytest.raises(ZeroDivisionError):
        c.run("k", lambda: 1 / 0, wait=False)
    assert c.keys() == 0


def test_fingerprints_ignore_bookkeeping() -> None:
    seen = Fingerprints()
    dep = {"metadata": {"labels": {}}, "spec": {"replicas": 1}, "status": {"replicas": 1, "readyReplicas": 0}}
    assert seen.changed("ns/d", deployment_fingerprint(dep))
    dep["status"]["observedGeneration"] = 2  # the controller's bookkeeping
    dep["status"]["conditions"] = [{"type": "Progressing", "status": "True"}]
    assert not seen.changed("ns/d", deployment_fingerprint(dep))
    dep["status"]["readyReplicas"] = 1
    assert seen.changed("ns/d", deployment_fingerprint(dep))
    dep["metadata"]["generation"] = 2   # someone edited the spec (the template): the reconcile checks it
    assert seen.changed("ns/d", deployment_fingerprint(dep))
    wl = {"metadata": {"name": "w", "labels": {}}, "spec": {}, "status": {}}
    assert seen.changed("ns/w", workload_fingerprint(wl))
    wl["status"] = {"requeueState": {"count": 1}}
    assert not seen.changed("ns/w", workload_fingerprint(wl))
    wl["status"] = {"conditions": [{"type": "Admitted", "status": "True"}], "admission": {"clusterQueue": "q"}}
    assert seen.changed("ns/w", workload_fingerprint(wl))
    seen.forget("ns/w")
    assert len(seen) == 1
