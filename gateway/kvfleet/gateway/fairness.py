"""Fair queuing between the tenants of one model (pure: no clock, no I/O, no asyncio).

Requests wait at the gateway only when they cannot go now: the model has no ready replica (it scales
from zero), or every replica is saturated (its requests in flight reach the engine's batch size,
`maxNumSeqs`). Otherwise they pass straight through.

**Virtual token counter** (VTC; Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
each tenant has a counter that grows by the tokens it is served divided by its weight, prompt tokens
counting 1 and completion tokens 2 (the paper's weights). A request is charged an estimate when it is
dispatched (its prompt, and twice its expected completion) and corrected by the engine's usage when it
ends, so a tenant's counter reflects its work in flight, not only finished work. When a slot frees,
the backlogged tenant with the smallest counter goes next (its oldest request): tenants that stay
backlogged are served tokens in proportion to their weights, and a lone tenant gets everything. A
tenant that (re)joins the backlog is lifted to the smallest counter of those backlogged (or to the
counter of the tenant last served), so credit is never banked while idle.

**A slot for a light tenant.** VTC orders who goes next; it cannot make a slot free. With few slots
and long requests, a light tenant's request would wait for a flood's request to finish even when it is
first in line. So a tenant that is *active* on the model (a request in the last `active_seconds`) and
has nothing queued or in flight keeps one slot free for its next request, up to half of the model's
slots: a flood gets every slot but those, and the light tenant's next request starts at once. That is
what keeps a quiet tenant's time to first token near its solo figure while another floods.

`fifo` (the benchmark's baseline) serves the oldest request first and keeps no slot free.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

POLICIES = ("vtc", "fifo")
PROMPT_WEIGHT, COMPLETION_WEIGHT = 1.0, 2.0


def token_cost(prompt_tokens: float, completion_tokens: float) -> float:
    """What a request counts against its tenant: prompt tokens x1, completion tokens x2."""
    return PROMPT_WEIGHT * prompt_tokens + COMPLETION_WEIGHT * completion_tokens


@dataclass(eq=False)
class Waiter:
    """One request waiting for a replica of the model."""

    tenant: str
    cost: float  # estimated tokens, charged when it is dispatched
    since: float  # when it began to wait (the caller's clock)
    held: bool  # it arrived while the model had no ready replica (scale from zero)
    seq: int = 0
    handle: Any = field(default=None, repr=False)  # the edge's (a future)


class FairQueue:
    """Per-tenant FIFOs of one model and the tenants' virtual token counters."""

    def __init__(self, policy: str = "vtc") -> None:
        if policy not in POLICIES:
            raise ValueError(f"fairness policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.counters: dict[str, float] = {}
        self._queues: dict[str, deque[Waiter]] = {}
        self._seq = itertools.count()
        self._last_served = 0.0  # the counter of the tenant served last, before its charge

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def depth(self, tenant: str) -> int:
        return len(self._queues.get(tenant) or ())

    def backlogged(self) -> set[str]:
        return {t for t, q in self._queues.items() if q}

    def waiters(self) -> list[Waiter]:
        return sorted((w for q in self._queues.values() for w in q), key=lambda w: w.seq)

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` arrives (queued or not): lift its counter if it was not backlogged."""
        if self.depth(tenant):
            return
        others = [self.counters.get(t, 0.0) for t in self.backlogged() if t != tenant]
        floor = min(others) if others else self._last_served
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def push(self, tenant: str, cost: float, since: float, held: bool = False, handle: Any = None) -> Waiter:
        self.arrive(tenant)
        waiter = Waiter(tenant, cost, since, held, next(self._seq), handle)
        self._queues.setdefault(tenant, deque()).append(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        queue = self._queues.get(waiter.tenant)
        if not queue or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.tenant]
        return True

    def pick(self, eligible: Callable[[str], bool] = lambda tenant: True,
             in_flight: Mapping[str, int] | None = None) -> Waiter | None:
        """The request to dispatch next among tenants that may take a slot now (not removed).

        Ties of counters go to the tenant with fewer requests in flight, then to the oldest request: a tenant
        that returns from idle is lifted exactly to the backlogged ones' counter, and must not lose the tie to a
        flood that already holds the model's slots."""
        heads = [q[0] for t, q in self._queues.items() if q and eligible(t)]
        if not heads:
            return None
        if self.policy == "fifo":
            return min(heads, key=lambda w: w.seq)
        busy = in_flight or {}
        return min(heads, key=lambda w: (self.counters.get(w.tenant, 0.0), busy.get(w.tenant, 0), w.seq))

    def charge(self, tenant: str, tokens: float, weight: float = 1.0, dispatched: bool = False) -> None:
        """Count `tokens` (a cost, or a correction, which may be negative) against `tenant`."""
        before = self.counters.get(tenant, 0.0)
        if dispatched:
            self._last_served = before
        self.counters[tenant] = before + tokens / max(weight, 1e-9)

    def forget_idle(self, keep: Iterable[str]) -> None:
        """Drop counters of tenants neither backlogged nor in `keep` (bounded memory; they are lifted anyway)."""
        live = set(keep) | self.backlogged()
        for tenant in [t for t in self.counters if t not in live]:
            del self.counters[tenant]


def free_slots(loads: Iterable[float], capacity: int) -> int:
    """Request slots free over replicas that each run up to `capacity` requests at once."""
    return sum(max(0, int(capacity - load)) for load in loads)


def reserved_for_others(tenant: str, active: Iterable[str], busy: Mapping[str, int], backlogged: set[str],
                        total_slots: int) -> int:
    """Slots `tenant` must leave free: one per other active tenant with nothing queued or in flight, up to
    half of the model's slots."""
    idle = sum(1 for t in set(active) if t != tenant and not busy.get(t) and t not in backlogged)
    return min(idle, total_slots // 2)


def may_dispatch(policy: str, tenant: str, free: int, active: Iterable[str], busy: Mapping[str, int],
                 backlogged: set[str], total_slots: int) -> bool:
    """Whether a request of `tenant` may take a slot now."""
    if policy == "fifo":
        return free >= 1
    return free - reserved_for_others(tenant, active, busy, backlogged, total_slots) >= 1
