"""The autoscaling policy: bursts, steady load, scale-down delay, unknown metrics, bounds."""

from __future__ import annotations

from typing import Sequence

import pytest

from kvfleet.operator.autoscaler.policy import (
    AutoscalerState,
    AutoscalingSpec,
    Decision,
    PodLoad,
    decide,
    needed_replicas,
)

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=8, target_queue_depth=4,
                       scale_down_delay_seconds=60)


def pods(*loads: tuple[float, float] | None) -> list[PodLoad]:
    """One PodLoad per (waiting, running) pair; None is an unreadable pod."""
    return [
        PodLoad(f"p{i}", None, None, "timeout") if load is None else PodLoad(f"p{i}", *load)
        for i, load in enumerate(loads)
    ]


def run(spec: AutoscalingSpec, current: int, ticks: Sequence[tuple[float, list[PodLoad]]]) -> list[Decision]:
    """Feed a sequence of (time, pods) through the policy, applying each decision."""
    state = AutoscalerState()
    out = []
    for now, observed in ticks:
        d = decide(spec, current, observed, state, now)
        out.append(d)
        current, state = d.desired, d.state
    return out


def test_needed_rounds_up_and_clamps() -> None:
    assert needed_replicas(0, SPEC) == 1
    assert needed_replicas(4, SPEC) == 1
    assert needed_replicas(4.5, SPEC) == 2
    assert needed_replicas(13, SPEC) == 4
    assert needed_replicas(1000, SPEC) == 8


def test_burst_scales_up_by_many_in_one_decision() -> None:
    d = decide(SPEC, 1, pods((20, 4)), AutoscalerState(), now=0)
    assert (d.action, d.current, d.desired, d.needed) == ("scale_up", 1, 6, 6)
    assert d.waiting == 20 and d.running == 4 and d.queue_depth == 24
    assert "needs 6 replicas" in d.reason


def test_burst_is_capped_at_max_replicas() -> None:
    d = decide(SPEC, 2, pods((100, 4), (100, 4)), AutoscalerState(), now=0)
    assert d.desired == 8 and d.action == "scale_up"


def test_steady_load_does_not_flap() -> None:
    # Demand hovers around the 2/3-replica boundary (needs 2, then 3, then 2, ...).
    loads = [(5, 3), (6, 4), (4, 3), (7, 4), (5, 3), (6, 4)] * 10
    ticks = [(t * 15.0, pods(load, (0, 0), (0, 0))) for t, load in enumerate(loads)]
    decisions = run(SPEC, 3, ticks)
    assert {d.desired for d in decisions} == {3}
    assert all(d.action == "hold" for d in decisions)


def test_scale_down_waits_for_the_delay() -> None:
    quiet = pods((0, 1), (0, 0), (0, 0), (0, 0))
    decisions = run(SPEC, 4, [(0, quiet), (30, quiet), (59, quiet), (60, quiet), (75, quiet)])
    assert [d.desired for d in decisions] == [4, 4, 4, 1, 1]
    assert decisions[0].state.low_demand_since == 0
    assert "59s so far" in decisions[2].reason
    assert decisions[3].action == "scale_down"
    assert decisions[3].state == AutoscalerState()  # window closed after reaching the need


def test_scale_down_follows_the_highest_need_of_the_last_delay() -> None:
    """Like the HPA's stabilisation window: the target is the highest need of the last delay seconds."""
    idle = (0, 0)
    ticks = [(0, pods((0, 1), idle, idle, idle)),    # needs 1 of 4: the window opens
             (20, pods((6, 4), idle, idle, idle)),   # needs 3
             (40, pods((1, 1), idle, idle, idle)),   # needs 1
             (60, pods(idle, idle, idle, idle)),     # delay over; need 3 (t=20) is still in the window
             (70, pods(idle, idle, idle, idle)),     # still in (10, 70]
             (80, pods(idle, idle, idle)),           # t=20 has left the window
             ]
    decisions = run(SPEC, 4, ticks)
    assert decisions[1].state.window_peak == 3
    assert [d.desired for d in decisions] == [4, 4, 4, 3, 3, 1]
    assert decisions[3].state.low_demand_since == 0  # still open: the peak, not the need, held it at 3
    assert decisions[5].state == AutoscalerState()


def test_window_keeps_few_entries() -> None:
    state = AutoscalerState()
    for t in range(0, 600, 15):  # 40 ticks of falling then flat demand, 8 replicas
        d = decide(AutoscalingSpec(1, 8, 1, 300), 8, pods((max(0, 7 - t // 60), 0)), state, float(t))
        state = d.state
    assert len(state.peaks) <= 8


def test_demand_back_at_current_restarts_the_window() -> None:
    ticks = [(0, pods((0, 0), (0, 0))), (40, pods((4, 4), (0, 0))),
             (70, pods((0, 0), (0, 0))), (100, pods((0, 0), (0, 0))),
             (130, pods((0, 0), (0, 0)))]
    decisions = run(SPEC, 2, ticks)
    assert [d.desired for d in decisions] == [2, 2, 2, 2, 1]
    assert decisions[1].state.low_demand_since is None
    assert decisions[2].state.low_demand_since == 70


def test_never_below_busy_replicas() -> None:
    # Need is 1 (three running requests) but they sit on three different pods.
    busy = pods((0, 1), (0, 1), (0, 1), (0, 0), (0, 0))
    decisions = run(SPEC, 5, [(0, busy), (60, busy)])
    assert (decisions[1].action, decisions[1].desired, decisions[1].busy) == ("scale_down", 3, 3)
    # The window stays open so the rest goes once those requests finish.
    assert decisions[1].state.low_demand_since == 0
    d = decide(SPEC, 3, pods((0, 0), (0, 0), (0, 0)), decisions[1].state, now=61)
    assert (d.action, d.desired) == ("scale_down", 1)


def test_busy_pods_can_block_scale_down_entirely() -> None:
    busy = pods((0, 1), (0, 1))
    d = decide(SPEC, 2, busy, AutoscalerState(low_demand_since=0, peaks=((90, 1),)), now=100)
    assert (d.action, d.desired) == ("hold", 2)
    assert "busy" in d.reason


def test_unknown_pod_blocks_scale_down_and_restarts_window() -> None:
    state = AutoscalerState(low_demand_since=0, peaks=((490, 1),))
    d = decide(SPEC, 3, pods((0, 0), None, (0, 0)), state, now=500)
    assert (d.action, d.desired) == ("hold", 3)
    assert d.unknown_pods == ("p1",) and d.known_pods == 2
    assert "unknown" in d.reason
    assert d.state == AutoscalerState()


def test_unknown_pod_does_not_prevent_scale_up() -> None:
    d = decide(SPEC, 2, pods((12, 4), None), AutoscalerState(), now=0)
    assert (d.action, d.desired) == ("scale_up", 4)
    assert d.unknown_pods == ("p1",)


def test_all_unknown_holds() -> None:
    d = decide(SPEC, 4, pods(None, None, None, None), AutoscalerState(), now=0)
    assert (d.action, d.desired, d.queue_depth) == ("hold", 4, 0)


def test_out_of_bounds_current_is_moved_into_range() -> None:
    spec = AutoscalingSpec(2, 3, 4, 60)
    assert decide(spec, 1, pods((0, 0)), AutoscalerState(), 0).desired == 2
    d = decide(spec, 6, pods(*[(0, 1)] * 6), AutoscalerState(), 0)
    assert (d.action, d.desired) == ("scale_down", 3)  # max wins over busy pods
    d = decide(spec, 0, pods((9, 2)), AutoscalerState(), 0)
    assert (d.action, d.desired) == ("scale_up", 3)  # below min with demand: straight to the need


def test_zero_delay_scales_down_on_first_quiet_tick() -> None:
    spec = AutoscalingSpec(1, 4, 4, 0)
    d = decide(spec, 4, pods((0, 0), (0, 0), (0, 0), (0, 0)), AutoscalerState(), 10)
    assert (d.action, d.desired) == ("scale_down", 1)


def test_decision_is_pure() -> None:
    args = (SPEC, 3, pods((1, 1), (0, 0), None), AutoscalerState(5, ((5, 2), (20, 1))), 30.0)
    assert decide(*args) == decide(*args)


@pytest.mark.parametrize(
    "field,value,spec",
    [
        ("minReplicas", -1, {"minReplicas": -1, "maxReplicas": 2}),
        ("maxReplicas", 1, {"minReplicas": 3, "maxReplicas": 1}),
        ("targetQueueDepth", 0, {"targetQueueDepth": 0}),
        ("scaleDownDelaySeconds", -5, {"scaleDownDelaySeconds": -5}),
        ("targetQueueDepth", "four", {"targetQueueDepth": "four"}),
    ],
)
def test_bad_spec_names_the_field(field: str, value: object, spec: dict) -> None:
    with pytest.raises(ValueError, match=field):
        AutoscalingSpec.from_spec(spec)


def test_from_spec_reads_camel_case() -> None:
    s = AutoscalingSpec.from_spec({"enabled": True, "minReplicas": 1, "maxReplicas": 5,
                                   "targetQueueDepth": 2, "scaleDownDelaySeconds": 30})
    assert s == AutoscalingSpec(1, 5, 2.0, 30.0)


# --- invariants over random observations (hypothesis) ---------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_load = st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 8)))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[AutoscalingSpec, int, list[PodLoad], AutoscalerState, float]:
    lo = draw(st.integers(0, 4))
    spec = AutoscalingSpec(lo, draw(st.integers(max(lo, 1), 10)), draw(st.integers(1, 10)),
                           draw(st.integers(0, 120)))
    current = draw(st.integers(0, 12))
    loads = draw(st.lists(_load, max_size=10))
    since = draw(st.one_of(st.none(), st.floats(0, 1000)))
    needs = sorted(set(draw(st.lists(st.integers(0, 12), max_size=4))), reverse=True)
    times = sorted(draw(st.lists(st.floats(0, 1000), min_size=len(needs), max_size=len(needs))))
    state = AutoscalerState(since, tuple(zip(times, needs, strict=True)) if since is not None else ())
    return spec, current, pods(*loads), state, draw(st.floats(1000, 2000))


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_policy_invariants(case: tuple[AutoscalingSpec, int, list[PodLoad], AutoscalerState, float]) -> None:
    spec, current, observed, state, now = case
    d = decide(spec, current, observed, state, now)
    in_range = spec.min_replicas <= current <= spec.max_replicas
    assert spec.min_replicas <= d.desired <= spec.max_replicas
    assert d.action == ("scale_up" if d.desired > current else "scale_down" if d.desired < current else "hold")
    if in_range and d.needed > current:
        assert d.desired == d.needed  # all the way up in one decision
    if in_range and d.action == "scale_down":
        assert not d.unknown_pods  # unknown is never read as zero
        assert d.desired >= max(d.busy, d.needed) or d.desired == spec.max_replicas
        since = now if state.low_demand_since is None else state.low_demand_since  # a window opening now
        assert now - since >= spec.scale_down_delay_seconds
    # Same inputs, same decision; and a decision taken again at once changes nothing more.
    assert decide(spec, current, observed, state, now) == d
    again = decide(spec, d.desired, observed, d.state, now)
    settled = again.action == "hold" or (d.action == "scale_down" and again.desired <= d.desired)
    assert settled, (spec, current, d, again)


ZERO = AutoscalingSpec(min_replicas=0, max_replicas=3, target_queue_depth=4, scale_down_delay_seconds=30)


def test_requests_waiting_at_the_gateway_wake_a_model_at_zero() -> None:
    idle = decide(ZERO, 0, [], AutoscalerState(), 0.0)
    assert idle.action == "hold" and idle.desired == 0
    woken = decide(ZERO, 0, [], AutoscalerState(), 0.0, gateway_waiting=1)
    assert woken.action == "scale_up" and woken.desired == 1 and woken.queue_depth == 1
    assert "1 at the gateway" in woken.reason
    many = decide(ZERO, 0, [], AutoscalerState(), 0.0, gateway_waiting=9)
    assert many.desired == 3  # ceil(9 / 4), within maxReplicas


def test_gateway_queue_adds_to_the_engines_depth() -> None:
    d = decide(ZERO, 1, pods((0, 4)), AutoscalerState(), 0.0, gateway_waiting=4)
    assert d.action == "scale_up" and d.desired == 2


def test_an_idle_model_goes_back_to_zero_after_the_delay() -> None:
    decisions = run(ZERO, 1, [(0.0, pods((0, 0))), (20.0, pods((0, 0))), (31.0, pods((0, 0)))])
    assert [d.desired for d in decisions] == [1, 1, 0]
    assert decisions[-1].action == "scale_down"
