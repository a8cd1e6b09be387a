"""The dispatch step: leases, exclusions, draining and failing replicas, loopback-only, load accounting."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.dispatch import DirectDispatcher, NoReplica, RouteRequest
from kvfleet.gateway.load import EngineLoad, LoadBoard
from kvfleet.gateway.replicas import Replica, is_loopback
from kvfleet.gateway.routing import RoutingConfig
from kvfleet.gateway.snapshot import Snapshot

MODEL = ModelRef(tenant="t", namespace="ns", deployment="chat", served_name="chat")


def snapshot(*hosts: str) -> Snapshot:
    reps = tuple(Replica(f"ns/pod-{i}", f"http://{h}:8000", h) for i, h in enumerate(hosts))
    return Snapshot(catalog=build_catalog([MODEL]), replicas={MODEL.key: reps})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def acquire(d: DirectDispatcher, snap: Snapshot, hashes: tuple[int, ...] = (), exclude: frozenset[str] = frozenset()):
    return asyncio.run(d.acquire(snap, RouteRequest("t", MODEL, hashes, exclude)))


def test_a_lease_counts_in_flight_until_released_once() -> None:
    board = LoadBoard()
    d = DirectDispatcher(board, RoutingConfig())
    lease = acquire(d, snapshot("127.0.0.1"))
    assert board.inflight("ns/pod-0") == 1
    lease.release()
    lease.release()
    assert board.inflight("ns/pod-0") == 0


def test_same_prefix_same_replica_different_prefix_spread() -> None:
    d = DirectDispatcher(LoadBoard(), RoutingConfig())
    snap = snapshot("127.0.0.1", "127.0.0.2", "127.0.0.3")
    first = acquire(d, snap, (1, 2, 3))
    first.release()
    again = acquire(d, snap, (1, 2, 3, 4))
    assert again.replica == first.replica and again.choice.rule == "prefix" and again.choice.matched_blocks == 3


def test_no_ready_replica_and_all_excluded_say_why() -> None:
    d = DirectDispatcher(LoadBoard(), RoutingConfig())
    with pytest.raises(NoReplica, match="has no ready replica"):
        acquire(d, snapshot())
    with pytest.raises(NoReplica, match="1 ready, all draining or failing"):
        acquire(d, snapshot("127.0.0.1"), exclude=frozenset({"ns/pod-0"}))


def test_draining_is_skipped_for_good_and_a_failed_one_for_a_while() -> None:
    clock = Clock()
    board = LoadBoard(eject_seconds=5, clock=clock)
    d = DirectDispatcher(board, RoutingConfig())
    snap = snapshot("127.0.0.1", "127.0.0.2")
    board.mark_draining("ns/pod-0")
    board.eject("ns/pod-1")
    with pytest.raises(NoReplica):
        acquire(d, snap)
    clock.now += 6
    assert acquire(d, snap).replica.name == "ns/pod-1"
    board.eject("ns/pod-1")
    board.scraped("ns/pod-1", EngineLoad(0, 0))  # it answers its /metrics again
    assert acquire(d, snap).replica.name == "ns/pod-1"


def test_loopback_only_never_routes_off_loopback() -> None:
    d = DirectDispatcher(LoadBoard(), RoutingConfig(), allow_host=is_loopback)
    with pytest.raises(NoReplica):
        acquire(d, snapshot("10.0.0.5"))
    assert acquire(d, snapshot("10.0.0.5", "127.0.0.9")).replica.host == "127.0.0.9"
    assert not is_loopback("example.com") and is_loopback("::1") and is_loopback("localhost")


def test_load_is_ours_live_plus_others_at_the_last_scrape() -> None:
    board = LoadBoard()
    board.started("r")
    board.started("r")
    board.scraped("r", EngineLoad(waiting=3, running=2, kv_usage=0.5))  # 5 there, 2 of them ours
    board.started("r")
    view = board.view("r")
    assert (view.inflight, view.others, view.load, view.kv_usage) == (3, 3.0, 6.0, 0.5)
    board.scrape_failed("r")
    assert board.view("r").load == 3
    board.keep_only([])
    assert board.inflight("r") == 3  # requests still in flight keep it


def test_a_request_that_ended_while_the_scrape_was_in_flight_is_no_phantom() -> None:
    board = LoadBoard()
    board.started("r")
    asked_with = board.inflight("r")  # 1 when the scrape is sent; the engine counts it...
    board.finished("r")  # ...and it ends before the answer is read
    board.scraped("r", EngineLoad(waiting=0, running=1), asked_with)
    assert board.view("r").load == 0
