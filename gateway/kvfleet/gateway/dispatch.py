"""The dispatch step: from a resolved model to a leased replica, through the tenant's limits and the model's queue.

The one place between "which model" and "which replica" (I/O-free decisions live in `limits`,
`fairness`, `waking` and `routing`; this module holds their state and the waiting requests' futures):

1. `admit`: the tenant's limits (requests and tokens per minute, concurrent requests), its usage here
   plus what the other gateway replicas report (`peers`) -> 429 `rate_limit_exceeded` naming the limit.
2. `acquire`, first attempt: a model with a free slot on a ready replica and nobody waiting -> a replica
   at once (`routing`: prefix and bounded load among the replicas with room). Otherwise the request waits
   in the model's per-tenant queues (`fairness`: VTC order, a slot kept for an idle active tenant):
   - no ready replica and the model is autoscaled: held while it scales from zero (`waking`: 429 with
     Kueue's reason when quota keeps it out, 503 / 504 past the admission / wake timeouts);
   - every replica saturated (requests in flight there reach `maxNumSeqs`): queued until a slot frees
     (503 past the queue timeout). Slots free when a lease is released, when a scrape shows the engines
     emptier, when a replica turns ready.
   A tenant with `max_queued_per_tenant` requests waiting for the model gets 429 `queue_full`.
3. `acquire`, a retry after a replica failed before its first byte: another usable replica at once, no
   queue (the request already waited its turn).

What waits here per ModelDeployment is the autoscaler's demand signal (`kvfleet_gateway_model_waiting_requests`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvfleet.gateway.catalog import ModelRef
from kvfleet.gateway.fairness import FairQueue, Waiter, free_slots, may_dispatch, token_cost
from kvfleet.gateway.limits import UsageLedger, check
from kvfleet.gateway.load import LoadBoard
from kvfleet.gateway.metrics import GatewayMetrics
from kvfleet.gateway.peers import PeerView
from kvfleet.gateway.prefix_index import PrefixIndex
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.routing import Choice, HashRing, RoutingConfig, choose
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.sse import Usage
from kvfleet.gateway.waking import WAIT, HoldConfig, ModelScale, Verdict, held_verdict, next_check

DEFAULT_CAPACITY = 256  # requests a replica runs at once when its ModelDeployment does not say (the engines' default)


@dataclass(frozen=True)
class RouteRequest:
    tenant: str
    model: ModelRef
    hashes: tuple[int, ...] = ()  # the prompt's prefix blocks (`prefix.request_hashes`)
    exclude: frozenset[str] = frozenset()  # replicas already tried for this request (a retry when not empty)
    cost: float = 0.0  # estimated tokens (prompt + 2 x completion), charged to the tenant's fair-share counter


class NoReplica(Exception):
    """The model has no replica that may take a request now, and none is coming."""


class Refused(Exception):
    """Answered without a replica: a limit, a full queue, quota, a timeout (OpenAI-shaped, with Retry-After)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    @classmethod
    def of(cls, verdict: Verdict) -> "Refused":
        return cls(verdict.status, verdict.code, verdict.message, verdict.retry_after)


@dataclass
class Lease:
    """A replica taken for one attempt; `release` exactly once when it is over, with the answer's usage."""

    replica: Replica
    choice: Choice
    _on_release: Callable[[Usage | None], None] = field(repr=False, default=lambda usage: None)
    _released: bool = field(default=False, repr=False)

    def release(self, usage: Usage | None = None) -> None:
        if not self._released:
            self._released = True
            self._on_release(usage)


class Admission:
    """A request admitted under its tenant's limits; `finish` exactly once when it is answered."""

    def __init__(self, on_finish: Callable[[int], None] = lambda tokens: None) -> None:
        self._on_finish = on_finish
        self._done = False

    def finish(self, tokens: int = 0) -> None:
        if not self._done:
            self._done = True
            self._on_finish(tokens)


class Dispatcher(Protocol):
    def admit(self, snapshot: Snapshot, tenant: str) -> Admission: ...

    async def acquire(self, snapshot: Snapshot, request: RouteRequest) -> Lease: ...


@dataclass(frozen=True)
class DispatchConfig:
    fairness: str = "vtc"  # vtc | fifo
    hold: HoldConfig = HoldConfig()
    replica_capacity: int = DEFAULT_CAPACITY
    active_seconds: float = 10.0  # a tenant with a request in this long is active (keeps a slot when idle)


class _ModelLine:
    """Per model: routing state (ring, prefix index, round-robin turn), the fair queue, who is active and busy."""

    def __init__(self, model: ModelRef, cfg: RoutingConfig, index_capacity: int, fairness: str) -> None:
        self.model = model
        self.cfg = cfg
        self.ring = HashRing((), cfg.virtual_nodes)
        self.index = PrefixIndex(index_capacity)
        self.turn = 0
        self.queue = FairQueue(fairness)
        self.seen: dict[str, float] = {}  # tenant -> its last request's arrival
        self.busy: dict[str, int] = {}  # tenant -> our requests in flight to the model
        self.pump_scheduled = False

    def refresh(self, names: frozenset[str]) -> None:
        if names != self.ring.members:
            self.ring = HashRing(sorted(names), self.cfg.virtual_nodes)
            self.index.keep_only(names)


class GatewayDispatcher:
    """Admission under limits, holding and fair queuing, then the routing choice (see the module's docstring)."""

    def __init__(self, board: LoadBoard, cfg: RoutingConfig, index_capacity: int = 16384,
                 allow_host: Callable[[str], bool] = lambda host: True, dispatch: DispatchConfig = DispatchConfig(),
                 metrics: GatewayMetrics | None = None, ledger: UsageLedger | None = None,
                 peers: PeerView | None = None, clock: Callable[[], float] = time.monotonic,
                 on_demand: Callable[[str, str, int], None] = lambda namespace, deployment, waiting: None) -> None:
        self.board = board
        self.cfg = cfg
        self.index_capacity = index_capacity
        self.allow_host = allow_host
        self.dispatch = dispatch
        self.metrics = metrics or GatewayMetrics()
        self.clock = clock
        self.ledger = ledger or UsageLedger(clock)
        self.peers = peers or PeerView(clock=clock)
        self.on_demand = on_demand  # (namespace, ModelDeployment, requests waiting): the autoscaler's signal
        self._lines: dict[str, _ModelLine] = {}
        self._snapshot = Snapshot()

    # -- limits ---------------------------------------------------------------------------------------------
    def admit(self, snapshot: Snapshot, tenant: str) -> Admission:
        limits = snapshot.policy(tenant).limits
        if limits.any:
            hit = check(tenant, limits, [self.ledger.usage(tenant), *self.peers.usages(tenant)])
            if hit is not None:
                self.metrics.limited.labels(tenant, hit.limit).inc()
                raise Refused(429, "rate_limit_exceeded", hit.message, hit.retry_after)
        self.ledger.started(tenant)
        gauge = self.metrics.in_progress.labels(tenant)
        gauge.inc()

        def finish(tokens: int) -> None:
            self.ledger.finished(tenant, tokens)
            gauge.dec()

        return Admission(finish)

    # -- cluster changes ------------------------------------------------------------------------------------
    def on_snapshot(self, snapshot: Snapshot) -> None:
        """A new snapshot: forget idle models that are gone, and let waiting requests see new replicas."""
        self._snapshot = snapshot
        live = set(snapshot.scale) | set(snapshot.replicas)
        for key in [k for k, line in self._lines.items() if k not in live and not len(line.queue) and not line.busy]:
            del self._lines[key]
        self.pump_all()

    def pump_all(self) -> None:
        """Dispatch what can go now in every model with requests waiting (after a scrape, a snapshot)."""
        for line in list(self._lines.values()):
            if len(line.queue):
                self._pump(line)

    def forget_models(self, live: set[str]) -> None:
        for key in [k for k, line in self._lines.items() if k not in live and not len(line.queue) and not line.busy]:
            del self._lines[key]

    # -- replicas -------------------------------------------------------------------------------------------
    async def acquire(self, snapshot: Snapshot, request: RouteRequest) -> Lease:
        self._snapshot = snapshot
        line = self._line(request.model)
        usable = self._usable(line, request.exclude)
        if request.exclude:  # a retry: it already waited its turn
            if not usable:
                raise NoReplica(self._why(request))
            return self._dispatch(line, usable, request, None)
        tenant = request.tenant
        line.seen[tenant] = self.clock()
        line.queue.arrive(tenant)
        scale = snapshot.model_scale(request.model.key)
        if not usable:
            if not scale.autoscaled:
                raise NoReplica(self._why(request))
            verdict = held_verdict(scale, 0.0, self.dispatch.hold, request.model.served_name)
            if verdict.action == "refuse":
                self._series(line, tenant).waited(verdict.code, 0.0)
                raise Refused.of(verdict)
        elif not len(line.queue) and self._may_go(line, usable, tenant, scale):
            return self._dispatch(line, usable, request, scale)
        return await self._wait(line, request, held=not usable)

    def _line(self, model: ModelRef) -> _ModelLine:
        found = self._lines.get(model.key)
        if found is None:
            found = self._lines[model.key] = _ModelLine(model, self.cfg, self.index_capacity, self.dispatch.fairness)
        return found

    def _usable(self, line: _ModelLine, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        ready = [r for r in self._snapshot.ready_replicas(line.model.key) if self.allow_host(r.host)]
        line.refresh(frozenset(r.name for r in ready))
        return [r for r in ready if r.name not in exclude and self.board.usable(r.name)]

    def _capacity(self, scale: ModelScale) -> int:
        return scale.capacity or self.dispatch.replica_capacity

    def _may_go(self, line: _ModelLine, usable: list[Replica], tenant: str, scale: ModelScale) -> bool:
        capacity = self._capacity(scale)
        free = free_slots((self.board.view(r.name).load for r in usable), capacity)
        now = self.clock()
        active = [t for t, seen in line.seen.items() if now - seen <= self.dispatch.active_seconds]
        return may_dispatch(self.dispatch.fairness, tenant, free, active, line.busy, line.queue.backlogged(),
                            capacity * len(usable))

    def _dispatch(self, line: _ModelLine, usable: list[Replica], request: RouteRequest,
                  scale: ModelScale | None) -> Lease:
        """Lease a replica now: among those with a free slot (any usable one for a retry), by the routing rules."""
        candidates = usable
        if scale is not None:
            capacity = self._capacity(scale)
            candidates = [r for r in usable if self.board.view(r.name).load < capacity] or usable
        by_name = {r.name: r for r in candidates}
        loads = [self.board.view(r.name) for r in candidates]
        matches = line.index.matches(by_name, request.hashes) if self.cfg.policy == "prefix" else {}
        choice = choose(loads, request.hashes, matches, line.ring, self.cfg, line.turn)
        line.turn += 1
        if self.cfg.policy == "prefix":
            line.index.record(choice.replica, request.hashes)
        tenant = request.tenant
        weight = self._snapshot.policy(tenant).weight
        self.board.started(choice.replica)
        line.busy[tenant] = line.busy.get(tenant, 0) + 1
        line.queue.charge(tenant, request.cost, weight, dispatched=True)

        def release(usage: Usage | None) -> None:
            self.board.finished(choice.replica)
            left = line.busy.get(tenant, 1) - 1
            if left > 0:
                line.busy[tenant] = left
            else:
                line.busy.pop(tenant, None)
            served = token_cost(usage.prompt_tokens, usage.completion_tokens) if usage is not None else 0.0
            line.queue.charge(tenant, served - request.cost, weight)  # the estimate corrected by the usage
            self._pump_soon(line)

        return Lease(by_name[choice.replica], choice, release)

    # -- waiting --------------------------------------------------------------------------------------------
    async def _wait(self, line: _ModelLine, request: RouteRequest, held: bool) -> Lease:
        tenant, name = request.tenant, request.model.served_name
        limit = self.dispatch.hold.max_queued_per_tenant
        series = self._series(line, tenant)
        if line.queue.depth(tenant) >= limit:
            series.waited("queue_full", 0.0)
            raise Refused(429, "queue_full", f"Tenant `{tenant}` already has {limit} requests waiting for the model "
                                             f"`{name}` at this gateway, the most it may queue; retry shortly.", 1)
        future: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        start = self.clock()
        waiter = line.queue.push(tenant, request.cost, start, held, (future, request))
        self._queue_changed(line, tenant)
        self._pump(line)
        outcome = "client_disconnected"
        try:
            while not future.done():
                try:
                    await asyncio.wait_for(asyncio.shield(future), self._next_check(line, waiter))
                except asyncio.TimeoutError:
                    verdict = self._verdict(line, waiter)
                    if verdict.action == "refuse" and not future.done():
                        future.set_exception(Refused.of(verdict))
            lease = future.result()  # Refused when the pump or a deadline answered it
            outcome = "dispatched"
            return lease
        except Refused as exc:
            outcome = exc.code
            raise
        finally:
            if line.queue.remove(waiter):
                self._queue_changed(line, tenant)
            if not future.done():
                future.cancel()
            elif outcome != "dispatched" and not future.cancelled() and future.exception() is None:
                future.result().release()  # leased as the client left: give it back unused
            series.waited(outcome, self.clock() - start)

    def _verdict(self, line: _ModelLine, waiter: Waiter) -> Verdict:
        waited = self.clock() - waiter.since
        name = line.model.served_name
        if not self._usable(line):
            scale = self._snapshot.model_scale(line.model.key)
            if not scale.autoscaled:
                return Verdict("refuse", 503, "no_replica", f"The model `{name}` has no ready replica.", 5)
            return held_verdict(scale, waited, self.dispatch.hold, name)
        limit = self.dispatch.hold.wake_timeout if waiter.held else self.dispatch.hold.queue_timeout
        if waited >= limit:
            return Verdict("refuse", 503, "queue_timeout",
                           f"Every replica of the model `{name}` stayed busy for {limit:g}s; retry later.", 5)
        return WAIT

    def _next_check(self, line: _ModelLine, waiter: Waiter) -> float:
        waited = self.clock() - waiter.since
        if not self._usable(line):
            return min(5.0, next_check(self._snapshot.model_scale(line.model.key), waited, self.dispatch.hold))
        limit = self.dispatch.hold.wake_timeout if waiter.held else self.dispatch.hold.queue_timeout
        return min(5.0, max(0.01, limit - waited))

    def _pump_soon(self, line: _ModelLine) -> None:
        if line.pump_scheduled or not len(line.queue):
            return
        line.pump_scheduled = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # released outside the loop (tests): pump now
            line.pump_scheduled = False
            self._pump(line)
            return

        def run() -> None:
            line.pump_scheduled = False
            self._pump(line)

        loop.call_soon(run)

    def _pump(self, line: _ModelLine) -> None:
        """Dispatch waiting requests while slots are free, in the queue's order; answer those that can only fail."""
        if not len(line.queue):
            return
        usable = self._usable(line)
        scale = self._snapshot.model_scale(line.model.key)
        if not usable:
            verdict = held_verdict(scale, 0.0, self.dispatch.hold, line.model.served_name) if scale.autoscaled \
                else Verdict("refuse", 503, "no_replica", f"The model `{line.model.served_name}` has no ready "
                                                          "replica.", 5)
            if verdict.action == "refuse":  # Kueue keeps it at zero, or nothing will bring a replica
                for waiter in line.queue.waiters():
                    self._answer(line, waiter, Refused.of(verdict))
            return
        while (head := line.queue.pick(lambda tenant: self._may_go(line, usable, tenant, scale),
                                       line.busy)) is not None:
            future, request = head.handle
            if future.done():
                self._answer(line, head, None)
                continue
            self._answer(line, head, self._dispatch(line, usable, request, scale))

    def _answer(self, line: _ModelLine, waiter: Waiter, result: Lease | Refused | None) -> None:
        line.queue.remove(waiter)
        self._queue_changed(line, waiter.tenant)
        future: asyncio.Future[Lease] = waiter.handle[0]
        if future.done() or result is None:
            return
        if isinstance(result, Refused):
            future.set_exception(result)
        else:
            future.set_result(result)

    # -- metrics --------------------------------------------------------------------------------------------
    def _series(self, line: _ModelLine, tenant: str) -> Any:
        return self.metrics.series(tenant, line.model.namespace, line.model.served_name)

    def _queue_changed(self, line: _ModelLine, tenant: str) -> None:
        self._series(line, tenant).queued.set(line.queue.depth(tenant))
        self.metrics.model_waiting.labels(line.model.namespace, line.model.deployment).set(len(line.queue))
        self.on_demand(line.model.namespace, line.model.deployment, len(line.queue))

    def waiting(self) -> dict[str, int]:
        """Requests waiting per model key (tests, logs)."""
        return {k: len(line.queue) for k, line in self._lines.items() if len(line.queue)}

    def _why(self, request: RouteRequest) -> str:
        model = f"{request.model.namespace}/{request.model.deployment}"
        ready = [r for r in self._snapshot.ready_replicas(request.model.key) if self.allow_host(r.host)]
        if not ready:
            return f"The model `{request.model.served_name}` has no ready replica (ModelDeployment {model})."
        return (f"No replica of the model `{request.model.served_name}` can take the request now "
                f"({len(ready)} ready, all draining or failing).")


DirectDispatcher = GatewayDispatcher  # the name tests and tools used before the queue existed
