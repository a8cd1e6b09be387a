"""Per-tenant limits (pure): the sliding window, Retry-After, usage shared with peers, the Tenant's fields."""

from __future__ import annotations

from kvfleet.gateway.limits import TenantUsage, UsageLedger, check
from kvfleet.gateway.peers import PeerView, parse_report
from kvfleet.gateway.tenancy import Limits, tenant_policy


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_tenant_policy_reads_the_fields_and_treats_bad_values_as_absent() -> None:
    policy = tenant_policy({"weight": 2, "limits": {"requestsPerMinute": 10, "tokensPerMinute": 500,
                                                    "maxConcurrentRequests": 3}})
    assert policy.weight == 2.0
    assert policy.limits == Limits(10, 500, 3)
    bad = tenant_policy({"weight": -1, "limits": {"requestsPerMinute": 0, "tokensPerMinute": "9",
                                                  "maxConcurrentRequests": True}})
    assert bad.weight == 1.0 and bad.limits == Limits() and not bad.limits.any
    assert tenant_policy(None).limits == Limits()


def test_requests_per_minute_refuse_at_the_limit_and_free_as_the_window_slides() -> None:
    clock = Clock()
    ledger = UsageLedger(clock)
    limits = Limits(requests_per_minute=3)
    for _ in range(3):
        assert check("a", limits, [ledger.usage("a")]) is None
        ledger.started("a")
        ledger.finished("a", 0)
        clock.t += 10
    hit = check("a", limits, [ledger.usage("a")])
    assert hit is not None and hit.limit == "requests_per_minute"
    assert "3 requests per minute" in hit.message and "requestsPerMinute" in hit.message
    assert hit.retry_after == 30  # the first request (30 s ago) leaves the window in 30 s
    clock.t += 30
    assert check("a", limits, [ledger.usage("a")]) is None


def test_tokens_per_minute_count_usage_when_requests_end() -> None:
    clock = Clock()
    ledger = UsageLedger(clock)
    limits = Limits(tokens_per_minute=100)
    ledger.started("a")
    assert check("a", limits, [ledger.usage("a")]) is None  # nothing ended yet
    ledger.finished("a", 120)
    hit = check("a", limits, [ledger.usage("a")])
    assert hit is not None and hit.limit == "tokens_per_minute" and "120 in the last 60s" in hit.message
    assert hit.retry_after == 60
    clock.t += 61
    assert check("a", limits, [ledger.usage("a")]) is None


def test_concurrent_requests_count_until_finished() -> None:
    ledger = UsageLedger(Clock())
    limits = Limits(concurrent_requests=2)
    ledger.started("a")
    ledger.started("a")
    hit = check("a", limits, [ledger.usage("a")])
    assert hit is not None and hit.limit == "concurrent_requests" and hit.retry_after == 1
    assert check("b", limits, [ledger.usage("b")]) is None  # another tenant is not affected
    ledger.finished("a", 5)
    assert check("a", limits, [ledger.usage("a")]) is None


def test_limits_are_shared_with_peers_reports() -> None:
    """Shared, not per replica: a peer's usage counts against the same limit, aged by the report's age."""
    clock = Clock()
    mine, theirs = UsageLedger(clock), UsageLedger(clock)
    for _ in range(2):
        mine.started("a")
        theirs.started("a")
    view = PeerView(stale_after=2.0, clock=clock)
    wire = {"tenants": {t: u.as_json() for t, u in theirs.report().items()}}
    view.update("http://peer", parse_report(wire))
    limits = Limits(requests_per_minute=4, concurrent_requests=10)
    hit = check("a", limits, [mine.usage("a"), *view.usages("a")])
    assert hit is not None and hit.limit == "requests_per_minute"
    assert check("a", limits, [mine.usage("a")]) is None  # alone, this replica would admit
    clock.t += 3  # the peer's report goes stale (peer gone): it no longer counts
    assert view.usages("a") == [] and view.fresh() == []


def test_usage_round_trips_and_bad_reports_are_dropped() -> None:
    usage = TenantUsage(2, ((1.5, 3),), ((0.5, 40),))
    assert TenantUsage.from_json(usage.as_json()) == usage
    assert TenantUsage.from_json({"concurrent": -3, "requests": [[1, "x"], "y"], "tokens": None}) == TenantUsage()
    assert usage.aged(2.0).requests == ((3.5, 3),)


def test_idle_tenants_are_forgotten() -> None:
    clock = Clock()
    ledger = UsageLedger(clock)
    ledger.started("a")
    ledger.finished("a", 10)
    assert set(ledger.report()) == {"a"}
    clock.t += 61
    assert ledger.report() == {}
