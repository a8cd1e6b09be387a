"""What the gateway knows of each replica's load and health (state, no I/O).

- `inflight`: this gateway's requests there now (exact, live).
- the engine's last scrape: waiting, running, KV-cache use, and this gateway's in-flight count at that
  moment, so `others` = what the engine had beyond our own requests. A surplus seen in one scrape only is
  not believed (the smaller of the last two scrapes' counts): an engine still counts a request for a step
  after its stream ended, and a scrape in that step would show a phantom that makes a replica look full
  (saturation) until the next scrape; another gateway's load shows in two scrapes running.
- `draining`: it answered 503 (its engine shuts down): no new requests for as long as it lives.
- `ejected_until`: it failed to answer (connect error, died): skipped for a short while.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from kvfleet.gateway.routing import ReplicaLoad


@dataclass(frozen=True)
class EngineLoad:
    """What one scrape of an engine's /metrics says."""

    waiting: float
    running: float
    kv_usage: float | None = None


@dataclass
class ReplicaHealth:
    inflight: int = 0
    scraped: EngineLoad | None = None
    inflight_at_scrape: int = 0
    others: float = 0.0  # requests there beyond ours, the smaller of the last two scrapes' counts
    last_surplus: float | None = None  # the last scrape's own count
    draining: bool = False
    ejected_until: float = 0.0


class LoadBoard:
    def __init__(self, eject_seconds: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.eject_seconds = eject_seconds
        self.clock = clock
        self._replicas: dict[str, ReplicaHealth] = {}

    def _get(self, name: str) -> ReplicaHealth:
        state = self._replicas.get(name)
        if state is None:
            state = self._replicas[name] = ReplicaHealth()
        return state

    def started(self, name: str) -> None:
        self._get(name).inflight += 1

    def finished(self, name: str) -> None:
        state = self._get(name)
        state.inflight = max(0, state.inflight - 1)

    def scraped(self, name: str, load: EngineLoad, inflight_when_asked: int | None = None) -> None:
        """`load` read from the engine; `inflight_when_asked`: ours when the scrape was sent. The engine counted
        its requests in between: of ours, the larger count, so a request that ended meanwhile is no phantom."""
        state = self._get(name)
        state.scraped = load
        state.inflight_at_scrape = max(state.inflight, inflight_when_asked or 0)
        surplus = max(0.0, load.waiting + load.running - state.inflight_at_scrape)
        state.others = surplus if state.last_surplus is None else min(surplus, state.last_surplus)
        state.last_surplus = surplus
        state.ejected_until = 0.0  # it answers again

    def scrape_failed(self, name: str) -> None:
        state = self._get(name)
        state.scraped, state.others, state.last_surplus = None, 0.0, None

    def mark_draining(self, name: str) -> None:
        self._get(name).draining = True

    def eject(self, name: str) -> None:
        self._get(name).ejected_until = self.clock() + self.eject_seconds

    def usable(self, name: str) -> bool:
        state = self._replicas.get(name)
        return state is None or (not state.draining and state.ejected_until <= self.clock())

    def inflight(self, name: str) -> int:
        state = self._replicas.get(name)
        return state.inflight if state else 0

    def view(self, name: str) -> ReplicaLoad:
        state = self._replicas.get(name)
        if state is None:
            return ReplicaLoad(name)
        others = 0.0
        kv = None
        if state.scraped is not None:
            others = state.others
            kv = state.scraped.kv_usage
        return ReplicaLoad(name, state.inflight, others, kv)

    def keep_only(self, names: Iterable[str]) -> None:
        """Forget replicas that are gone; those with requests in flight stay until they finish."""
        live = set(names)
        for name in [n for n, s in self._replicas.items() if n not in live and s.inflight == 0]:
            del self._replicas[name]
