"""Fair queuing between tenants (pure): the virtual token counter's order and shares, the slot kept free."""

from __future__ import annotations

import pytest

from kvfleet.gateway.fairness import FairQueue, free_slots, may_dispatch, reserved_for_others, token_cost


def serve(queue: FairQueue, weights: dict[str, float], n: int) -> dict[str, float]:
    """Dispatch `n` requests in the queue's order, charging each its cost; tokens served per tenant."""
    served: dict[str, float] = {}
    for _ in range(n):
        head = queue.pick()
        assert head is not None
        queue.remove(head)
        queue.charge(head.tenant, head.cost, weights[head.tenant], dispatched=True)
        served[head.tenant] = served.get(head.tenant, 0.0) + head.cost
        queue.push(head.tenant, head.cost, 0.0)  # backlogged tenants stay backlogged
    return served


def test_token_cost_weighs_completion_twice() -> None:
    assert token_cost(100, 50) == 200


def test_backlogged_tenants_get_tokens_in_proportion_to_weight() -> None:
    queue = FairQueue("vtc")
    weights = {"a": 1.0, "b": 3.0}
    for _ in range(5):
        queue.push("a", 100.0, 0.0)
        queue.push("b", 100.0, 0.0)
    served = serve(queue, weights, 400)
    assert served["b"] / served["a"] == pytest.approx(3.0, rel=0.05)


def test_a_heavy_requester_does_not_starve_a_light_one() -> None:
    """Token-weighted: a tenant sending 10x larger requests gets as many tokens, so far fewer requests."""
    queue = FairQueue("vtc")
    for _ in range(5):
        queue.push("flood", 1000.0, 0.0)
        queue.push("quiet", 100.0, 0.0)
    served = serve(queue, {"flood": 1.0, "quiet": 1.0}, 220)
    assert served["quiet"] == pytest.approx(served["flood"], rel=0.1)


def test_fifo_serves_in_arrival_order() -> None:
    queue = FairQueue("fifo")
    for tenant in ("a", "a", "b"):
        queue.push(tenant, 1.0, 0.0)
    head = queue.pick()
    assert head is not None and head.tenant == "a"
    queue.charge("a", 1000.0, dispatched=True)
    head = queue.pick()
    assert head is not None and head.tenant == "a"  # counters do not matter to fifo


def test_a_returning_tenant_is_lifted_and_banks_no_credit() -> None:
    queue = FairQueue("vtc")
    queue.charge("busy", 10_000.0, dispatched=True)
    queue.push("busy", 10.0, 0.0)
    queue.arrive("idle")  # it has been idle: its counter is lifted to the backlogged ones' smallest
    assert queue.counters["idle"] == queue.counters["busy"]


def test_correction_by_usage_and_unknown_policy() -> None:
    queue = FairQueue()
    queue.charge("a", 500.0, dispatched=True)
    queue.charge("a", -300.0)  # the estimate was 300 too high
    assert queue.counters["a"] == 200.0
    with pytest.raises(ValueError, match="fairness policy"):
        FairQueue("lottery")


def test_removal_and_depth() -> None:
    queue = FairQueue()
    w = queue.push("a", 1.0, 0.0)
    assert queue.depth("a") == 1 and len(queue) == 1 and queue.backlogged() == {"a"}
    assert queue.remove(w) and not queue.remove(w)
    assert len(queue) == 0 and queue.pick() is None


def test_slots_and_the_slot_kept_for_an_idle_active_tenant() -> None:
    assert free_slots([3, 4, 0], 4) == 5
    # the flood may take every slot but one while the quiet tenant is active with nothing in flight
    assert reserved_for_others("flood", ["flood", "quiet"], {"flood": 7}, {"flood"}, 8) == 1
    assert may_dispatch("vtc", "flood", 2, ["flood", "quiet"], {"flood": 6}, {"flood"}, 8)
    assert not may_dispatch("vtc", "flood", 1, ["flood", "quiet"], {"flood": 7}, {"flood"}, 8)
    assert may_dispatch("vtc", "quiet", 1, ["flood", "quiet"], {"flood": 7}, {"flood"}, 8)
    # once the quiet tenant has a request in flight, nothing is kept for it
    assert may_dispatch("vtc", "flood", 1, ["flood", "quiet"], {"flood": 6, "quiet": 1}, {"flood"}, 8)
    # fifo keeps nothing; never more than half the slots are kept
    assert may_dispatch("fifo", "flood", 1, ["flood", "quiet"], {"flood": 7}, {"flood"}, 8)
    assert reserved_for_others("x", ["a", "b", "c", "d", "x"], {}, set(), 4) == 2


def test_a_returning_tenant_wins_the_tie_against_a_tenant_holding_the_slots() -> None:
    queue = FairQueue("vtc")
    for _ in range(3):
        queue.push("flood", 188.0, 0.0)
    queue.charge("flood", 188.0 * 3, dispatched=True)
    queue.push("quiet", 20.0, 1.0)  # lifted to the flood's counter: a tie
    assert queue.counters["quiet"] == queue.counters["flood"]
    head = queue.pick(in_flight={"flood": 3})
    assert head is not None and head.tenant == "quiet"
    head = queue.pick()  # without knowing who holds slots, the older request goes first
    assert head is not None and head.tenant == "flood"
