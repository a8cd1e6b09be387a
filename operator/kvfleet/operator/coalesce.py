"""One reconcile per object at a time, and bursts of triggers folded into one more pass (a controller's work queue).

Every event of an owned Workload or Deployment asks for its ModelDeployment's reconcile, and a reconcile reads the
whole state afresh; so triggers that arrive while one runs need one more pass after it, not one each. A trigger
either runs the reconcile in the caller's thread or, when one is running, marks it dirty and returns at once
(`wait=False`, the event handlers) or waits for the pass that covers it and returns that pass's result
(`wait=True`, the create/update handlers, which need the outcome). A pass that fails with `kopf.TemporaryError`
(the apiserver busy or away) is run again after its delay, as a work queue requeues, even when what asked for it
was an event handler, which kopf never retries.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

log = logging.getLogger("kvfleet.operator.coalesce")

Pass = Callable[[], Any]


@dataclass
class _Key:
    running: bool = False
    pending: Pass | None = None  # the pass to run next (a trigger arrived while one ran)
    pending_rank: int = -1
    started: int = 0  # passes begun
    finished: int = 0  # passes ended
    outcome: tuple[bool, Any] = (True, None)  # (ok, result or exception) of the last pass
    waiters: int = 0
    retry: threading.Timer | None = None
    ready: threading.Condition = field(default_factory=threading.Condition)


class Coalescer:
    """`run(key, fn, wait, rank)`: at most one pass per key at a time. A pass asked for while one runs is folded
    into a single next pass; of the passes asked for, the one of highest `rank` runs (a full reconcile covers a
    status refresh)."""

    def __init__(self, timer: Callable[[float, Callable[[], None]], threading.Timer] | None = None) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, _Key] = {}
        self._timer = timer or (lambda delay, fn: threading.Timer(delay, fn))

    def run(self, key: str, fn: Pass, *, wait: bool, rank: int = 0) -> Any:
        with self._lock:
            k = self._keys.setdefault(key, _Key())
            if k.retry is not None:  # this pass does what the scheduled retry would
                k.retry.cancel()
                k.retry = None
            if not k.running:
                k.running = True  # this caller drives
                target = None
            else:
                if rank >= k.pending_rank:
                    k.pending, k.pending_rank = fn, rank
                if not wait:
                    return None
                k.waiters += 1
                target = k.started + 1  # the pass that starts after this trigger
        if target is not None:
            return self._wait_for(key, k, target)
        return self._drive(key, k, fn)

    def _wait_for(self, key: str, k: _Key, target: int) -> Any:
        with k.ready:
            while True:
                with self._lock:
                    if k.finished >= target:
                        k.waiters -= 1
                        ok, value = k.outcome
                        self._forget_if_idle(key, k)
                        break
                k.ready.wait(1.0)
        if not ok:
            raise value
        return value

    def _drive(self, key: str, k: _Key, fn: Pass) -> Any:
        """Run passes until no trigger is pending; the first pass's outcome is this caller's."""
        first: tuple[bool, Any] | None = None
        while True:
            with self._lock:
                k.started += 1
                k.pending, k.pending_rank = None, -1
            try:
                outcome: tuple[bool, Any] = (True, fn())
            except Exception as exc:  # handed to the caller (and to waiters) below
                outcome = (False, exc)
            with self._lock:
                k.finished += 1
                k.outcome = outcome
                nxt = k.pending
                if nxt is None:
                    k.running = False
                    if not outcome[0] and isinstance(outcome[1], kopf.TemporaryError):
                        self._schedule_retry(key, k, fn, outcome[1])
                    self._forget_if_idle(key, k)
            with k.ready:
                k.ready.notify_all()
            if first is None:
                first = outcome
            if nxt is None:
                break
            fn = nxt
        ok, value = first
        if not ok:
            raise value
        return value

    def _schedule_retry(self, key: str, k: _Key, fn: Pass, exc: kopf.TemporaryError) -> None:
        """Run the failed pass again after its delay (called with the lock held)."""
        delay = float(exc.delay or 5)

        def again() -> None:
            with self._lock:
                if k.retry is None:  # cancelled: someone ran it meanwhile
                    return
                k.retry = None
            try:
                self.run(key, fn, wait=False)
            except kopf.TemporaryError as err:  # rescheduled by run(); one line, no traceback
                log.warning("retry of %s failed: %s", key, err)
            except Exception:
                log.exception("retry of %s failed", key)

        k.retry = self._timer(delay, again)
        k.retry.daemon = True
        k.retry.start()

    def _forget_if_idle(self, key: str, k: _Key) -> None:
        """Drop the key's record when nothing runs, waits or is scheduled (lock held): no growth with churn."""
        if not k.running and not k.waiters and k.retry is None and k.pending is None and self._keys.get(key) is k:
            del self._keys[key]

    def keys(self) -> int:
        with self._lock:
            return len(self._keys)
