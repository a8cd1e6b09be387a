"""Per-tenant limits: a sliding one-minute window of requests and tokens, and requests in progress (pure).

- **Requests per minute**: a request counts when it is admitted; the next is refused while the last
  60 s already hold the limit.
- **Tokens per minute**: prompt + completion tokens from the engines' usage, counted when a request
  ends; a request is refused while the last 60 s already hold the limit (a request's own tokens are
  not known before it runs, so the window may end above the limit by the requests then in flight).
- **Concurrent requests**: admitted and not yet answered, queued at the gateway or in flight.

The window is kept in one-second buckets. `Retry-After` is the time until enough of the window has
expired for the next request to fit (at least 1 s).

**Several gateway replicas** share the limits, not split them: each reports its own usage to the
others (`peers`, every half second by default) and admits a request only if its own usage plus what
the others last reported is under the limit. So a tenant gets its full limit whichever replicas its
connections land on; between two reports the replicas may together admit up to what each admitted in
that interval beyond the limit (a replica that cannot be read counts as idle until it can).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from kvfleet.gateway.tenancy import Limits

WINDOW_S = 60.0
BUCKET_S = 1.0


@dataclass(frozen=True)
class TenantUsage:
    """One replica's usage of one tenant: requests in progress and the window's buckets as (age s, amount)."""

    concurrent: int = 0
    requests: tuple[tuple[float, int], ...] = ()
    tokens: tuple[tuple[float, int], ...] = ()

    def aged(self, seconds: float) -> "TenantUsage":
        """The same usage `seconds` later (a peer's report read a while ago)."""
        return TenantUsage(self.concurrent, tuple((a + seconds, n) for a, n in self.requests),
                           tuple((a + seconds, n) for a, n in self.tokens))

    def as_json(self) -> dict[str, object]:
        return {"concurrent": self.concurrent, "requests": [list(b) for b in self.requests],
                "tokens": [list(b) for b in self.tokens]}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> "TenantUsage":
        def buckets(value: object) -> tuple[tuple[float, int], ...]:
            out = []
            for item in value if isinstance(value, list) else ():
                if isinstance(item, list) and len(item) == 2 and all(isinstance(x, (int, float)) for x in item):
                    out.append((float(item[0]), int(item[1])))
            return tuple(out)

        concurrent = data.get("concurrent")
        return cls(concurrent if isinstance(concurrent, int) and concurrent > 0 else 0,
                   buckets(data.get("requests")), buckets(data.get("tokens")))


@dataclass(frozen=True)
class LimitHit:
    limit: str  # requests_per_minute | tokens_per_minute | concurrent_requests
    message: str
    retry_after: int


def _in_window(buckets: Iterable[tuple[float, int]], window: float) -> list[tuple[float, int]]:
    return [(age, n) for age, n in buckets if age < window and n > 0]


def _retry_after(buckets: list[tuple[float, int]], limit: int, window: float) -> int:
    """Seconds until the window's total drops below `limit` as its oldest buckets expire."""
    total = sum(n for _, n in buckets)
    for age, n in sorted(buckets, reverse=True):  # oldest first
        total -= n
        if total < limit:
            return max(1, math.ceil(window - age))
    return 1


def check(tenant: str, limits: Limits, usages: Sequence[TenantUsage], window: float = WINDOW_S) -> LimitHit | None:
    """Whether one more request of `tenant` fits, given every replica's usage (this one's included)."""
    if limits.concurrent_requests is not None:
        now = sum(u.concurrent for u in usages)
        if now >= limits.concurrent_requests:
            return LimitHit("concurrent_requests",
                            f"Tenant `{tenant}` has {now} requests in progress, its limit of "
                            f"{limits.concurrent_requests} concurrent requests (maxConcurrentRequests); "
                            "retry when one ends.", 1)
    for name, limit, field, what in (
            ("requests_per_minute", limits.requests_per_minute, "requests", "requests per minute"),
            ("tokens_per_minute", limits.tokens_per_minute, "tokens", "tokens per minute (prompt + completion)")):
        if limit is None:
            continue
        buckets = _in_window((b for u in usages for b in getattr(u, field)), window)
        used = sum(n for _, n in buckets)
        if used >= limit:
            retry = _retry_after(buckets, limit, window)
            setting = "requestsPerMinute" if field == "requests" else "tokensPerMinute"
            return LimitHit(name, f"Tenant `{tenant}` is over its limit of {limit} {what} ({setting}: {used} in "
                                  f"the last {window:g}s); retry in {retry}s.", retry)
    return None


class UsageLedger:
    """This replica's usage per tenant (clock injected)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = WINDOW_S) -> None:
        self.clock = clock
        self.window = window
        self._concurrent: dict[str, int] = {}
        self._buckets: dict[str, deque[list[float]]] = {}  # [bucket start, requests, tokens], oldest first

    def _bucket(self, tenant: str) -> list[float]:
        now = self.clock()
        start = math.floor(now / BUCKET_S) * BUCKET_S
        buckets = self._buckets.setdefault(tenant, deque())
        while buckets and buckets[0][0] <= now - self.window:
            buckets.popleft()
        if not buckets or buckets[-1][0] != start:
            buckets.append([start, 0, 0])
        return buckets[-1]

    def started(self, tenant: str) -> None:
        self._concurrent[tenant] = self._concurrent.get(tenant, 0) + 1
        self._bucket(tenant)[1] += 1

    def finished(self, tenant: str, tokens: int) -> None:
        self._concurrent[tenant] = max(0, self._concurrent.get(tenant, 0) - 1)
        if tokens > 0:
            self._bucket(tenant)[2] += tokens

    def concurrent(self, tenant: str) -> int:
        return self._concurrent.get(tenant, 0)

    def usage(self, tenant: str) -> TenantUsage:
        now = self.clock()
        buckets = [b for b in self._buckets.get(tenant) or () if b[0] > now - self.window]
        return TenantUsage(self._concurrent.get(tenant, 0),
                           tuple((now - b[0], int(b[1])) for b in buckets if b[1]),
                           tuple((now - b[0], int(b[2])) for b in buckets if b[2]))

    def report(self) -> dict[str, TenantUsage]:
        """Every tenant with usage in the window or in progress (what peers read); idle ones are forgotten."""
        out = {}
        for tenant in sorted(set(self._buckets) | set(self._concurrent)):
            usage = self.usage(tenant)
            if usage.concurrent or usage.requests or usage.tokens:
                out[tenant] = usage
            else:
                self._buckets.pop(tenant, None)
                self._concurrent.pop(tenant, None)
        return out
