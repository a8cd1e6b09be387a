"""The per-model dispatch step: from a resolved model to a leased replica.

This is the one place between "which model" and "which replica". Today it chooses at once (routing
rules in `routing`) or answers that the model has no ready replica. The next steps of the request path
belong here and nowhere else: holding requests while a model scales from zero, per-tenant limits,
and fair queuing between tenants when every replica is saturated; `Dispatcher` is the seam (`acquire`
may wait).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvfleet.gateway.catalog import ModelRef
from kvfleet.gateway.load import LoadBoard
from kvfleet.gateway.prefix_index import PrefixIndex
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.routing import Choice, HashRing, RoutingConfig, choose
from kvfleet.gateway.snapshot import Snapshot


@dataclass(frozen=True)
class RouteRequest:
    tenant: str
    model: ModelRef
    hashes: tuple[int, ...] = ()  # the prompt's prefix blocks (`prefix.request_hashes`)
    exclude: frozenset[str] = frozenset()  # replicas already tried for this request


class NoReplica(Exception):
    """The model has no replica that may take a request now."""


@dataclass
class Lease:
    """A replica taken for one request; `release` exactly once when the request is over."""

    replica: Replica
    choice: Choice
    _on_release: Callable[[], None] = field(repr=False, default=lambda: None)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release()


class Dispatcher(Protocol):
    async def acquire(self, snapshot: Snapshot, request: RouteRequest) -> Lease: ...


class _ModelRouting:
    """Per model: its ring (rebuilt when the replica set changes), prefix index and round-robin turn."""

    def __init__(self, cfg: RoutingConfig, index_capacity: int) -> None:
        self.cfg = cfg
        self.ring = HashRing((), cfg.virtual_nodes)
        self.index = PrefixIndex(index_capacity)
        self.turn = 0

    def refresh(self, names: frozenset[str]) -> None:
        if names != self.ring.members:
            self.ring = HashRing(sorted(names), self.cfg.virtual_nodes)
            self.index.keep_only(names)


class DirectDispatcher:
    """Chooses a replica at once; `NoReplica` when none is ready, usable and allowed."""

    def __init__(self, board: LoadBoard, cfg: RoutingConfig, index_capacity: int = 16384,
                 allow_host: Callable[[str], bool] = lambda host: True) -> None:
        self.board = board
        self.cfg = cfg
        self.index_capacity = index_capacity
        self.allow_host = allow_host
        self._models: dict[str, _ModelRouting] = {}

    def _routing(self, model_key: str) -> _ModelRouting:
        found = self._models.get(model_key)
        if found is None:
            found = self._models[model_key] = _ModelRouting(self.cfg, self.index_capacity)
        return found

    def forget_models(self, live: set[str]) -> None:
        for key in [k for k in self._models if k not in live]:
            del self._models[key]

    async def acquire(self, snapshot: Snapshot, request: RouteRequest) -> Lease:
        ready = [r for r in snapshot.ready_replicas(request.model.key) if self.allow_host(r.host)]
        routing = self._routing(request.model.key)
        routing.refresh(frozenset(r.name for r in ready))
        candidates = [r for r in ready if r.name not in request.exclude and self.board.usable(r.name)]
        if not candidates:
            raise NoReplica(self._why(request, ready))
        by_name = {r.name: r for r in candidates}
        loads = [self.board.view(r.name) for r in candidates]
        matches = routing.index.matches(by_name, request.hashes) if self.cfg.policy == "prefix" else {}
        choice = choose(loads, request.hashes, matches, routing.ring, self.cfg, routing.turn)
        routing.turn += 1
        if self.cfg.policy == "prefix":
            routing.index.record(choice.replica, request.hashes)
        self.board.started(choice.replica)
        return Lease(by_name[choice.replica], choice, lambda: self.board.finished(choice.replica))

    def _why(self, request: RouteRequest, ready: list[Replica]) -> str:
        model = f"{request.model.namespace}/{request.model.deployment}"
        if not ready:
            return f"The model `{request.model.served_name}` has no ready replica (ModelDeployment {model})."
        return (f"No replica of the model `{request.model.served_name}` can take the request now "
                f"({len(ready)} ready, all draining or failing).")
