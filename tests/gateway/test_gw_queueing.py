"""The dispatcher's waiting: requests held for a model at zero, refused on quota, queued fairly when saturated."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.gateway.catalog import ModelRef, build_catalog
from kvfleet.gateway.dispatch import DispatchConfig, GatewayDispatcher, Lease, Refused, RouteRequest
from kvfleet.gateway.load import LoadBoard
from kvfleet.gateway.replicas import Replica
from kvfleet.gateway.routing import RoutingConfig
from kvfleet.gateway.snapshot import Snapshot
from kvfleet.gateway.tenancy import Limits, TenantPolicy
from kvfleet.gateway.waking import HoldConfig, ModelScale

MODEL = ModelRef(tenant="flood", namespace="ns", deployment="chat", served_name="chat", shared_with=("quiet",))
REPLICA = Replica("ns/pod-0", "http://127.0.0.1:8000", "127.0.0.1")


def snap(ready: bool, scale: ModelScale, policies: dict[str, TenantPolicy] | None = None) -> Snapshot:
    return Snapshot(catalog=build_catalog([MODEL]), replicas={MODEL.key: (REPLICA,) if ready else ()},
                    scale={MODEL.key: scale}, policies=policies or {})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_request_for_a_model_at_zero_is_held_until_a_replica_is_ready() -> None:
    async def run() -> None:
        demand: list[int] = []
        d = GatewayDispatcher(LoadBoard(), RoutingConfig(), on_demand=lambda ns, name, n: demand.append(n))
        zero = snap(False, ModelScale(autoscaled=True))
        task = asyncio.create_task(d.acquire(zero, RouteRequest("quiet", MODEL, cost=10)))
        await settle()
        assert not task.done() and d.waiting() == {MODEL.key: 1} and demand == [1]
        d.on_snapshot(snap(False, ModelScale(autoscaled=True, desired=1, admitted=1)))  # admitted, not ready
        await settle()
        assert not task.done()
        d.on_snapshot(snap(True, ModelScale(autoscaled=True, desired=1, admitted=1, ready=1)))
        lease = await asyncio.wait_for(task, 1)
        assert isinstance(lease, Lease) and lease.replica == REPLICA and demand[-1] == 0
        lease.release()

    asyncio.run(run())


def test_quota_refusal_answers_every_held_request_with_kueues_reason() -> None:
    async def run() -> None:
        d = GatewayDispatcher(LoadBoard(), RoutingConfig(), dispatch=DispatchConfig(hold=HoldConfig(
            quota_retry_after=30)))
        zero = snap(False, ModelScale(autoscaled=True))
        tasks = [asyncio.create_task(d.acquire(zero, RouteRequest(t, MODEL))) for t in ("quiet", "flood")]
        await settle()
        d.on_snapshot(snap(False, ModelScale(autoscaled=True, desired=1, quota_message="insufficient quota X")))
        for task in tasks:
            with pytest.raises(Refused) as err:
                await asyncio.wait_for(task, 1)
            assert err.value.status == 429 and err.value.code == "quota_exceeded"
            assert "insufficient quota X" in err.value.message and err.value.retry_after == 30
        assert d.waiting() == {}

    asyncio.run(run())


def test_a_model_not_autoscaled_at_zero_is_not_held() -> None:
    from kvfleet.gateway.dispatch import NoReplica

    d = GatewayDispatcher(LoadBoard(), RoutingConfig())
    with pytest.raises(NoReplica):
        asyncio.run(d.acquire(snap(False, ModelScale()), RouteRequest("quiet", MODEL)))


def test_saturated_model_serves_a_returning_quiet_tenant_before_the_flood_backlog() -> None:
    async def run() -> None:
        board = LoadBoard()
        d = GatewayDispatcher(board, RoutingConfig(), dispatch=DispatchConfig(active_seconds=10))
        ready = snap(True, ModelScale(desired=1, admitted=1, ready=1, capacity=4))
        quiet = await d.acquire(ready, RouteRequest("quiet", MODEL, cost=20))
        quiet.release()
        flood = [asyncio.create_task(d.acquire(ready, RouteRequest("flood", MODEL, cost=188))) for _ in range(8)]
        await settle()
        leased = [t for t in flood if t.done()]
        assert len(leased) == 3  # 4 slots, one kept free for the quiet tenant (active, nothing in flight)
        assert board.inflight(REPLICA.name) == 3
        lease = await asyncio.wait_for(d.acquire(ready, RouteRequest("quiet", MODEL, cost=20)), 1)
        assert board.inflight(REPLICA.name) == 4  # went at once, ahead of 5 queued flood requests
        lease.release()
        for t in leased:
            t.result().release()
        await settle()
        for t in flood:
            if not t.done():
                t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)

    asyncio.run(run())


def test_limits_are_checked_at_admission() -> None:
    d = GatewayDispatcher(LoadBoard(), RoutingConfig())
    s = snap(True, ModelScale(capacity=4), {"quiet": TenantPolicy(1.0, Limits(concurrent_requests=1))})
    first = d.admit(s, "quiet")
    with pytest.raises(Refused) as err:
        d.admit(s, "quiet")
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    first.finish(10)
    d.admit(s, "quiet").finish()
    assert d.metrics.limited.labels("quiet", "concurrent_requests")._value.get() == 1


def test_a_surplus_seen_in_one_scrape_only_is_not_believed() -> None:
    """An engine counts a finished request for a step after its stream ended: one scrape's phantom must not make
    the replica look full; a surplus in two scrapes running (another gateway's requests) counts."""
    from kvfleet.gateway.load import EngineLoad

    board = LoadBoard()
    for _ in range(3):
        board.started("r")
    board.scraped("r", EngineLoad(waiting=0, running=3), 3)
    board.scraped("r", EngineLoad(waiting=0, running=4), 3)  # the phantom
    assert board.view("r").others == 0 and board.view("r").load == 3
    board.scraped("r", EngineLoad(waiting=0, running=5), 3)  # two scrapes with more than ours: real
    assert board.view("r").others == 1
    board.scrape_failed("r")
    board.scraped("r", EngineLoad(waiting=2, running=3), 3)  # a fresh start believes the first scrape
    assert board.view("r").others == 2
