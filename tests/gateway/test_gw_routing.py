"""Replica choice: bounded load, longest cached prefix, the ring, least load, round-robin."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.gateway.routing import HashRing, ReplicaLoad, RoutingConfig, choose, eligible, load_bound

NAMES = ["ns/pod-a", "ns/pod-b", "ns/pod-c"]
PREFIX = RoutingConfig()


def loads(*values: float, kv: tuple[float | None, ...] = ()) -> list[ReplicaLoad]:
    kvs = list(kv) + [None] * (len(values) - len(kv))
    names = NAMES[:len(values)]
    return [ReplicaLoad(n, inflight=int(v), kv_usage=k) for n, v, k in zip(names, values, kvs, strict=True)]


def test_bound_is_c_times_the_mean_counting_the_new_request() -> None:
    assert load_bound([0, 0, 0], 1.25) == 1
    assert load_bound([4, 4, 4], 1.25) == math.ceil(1.25 * 13 / 3) == 6
    assert [r.name for r in eligible(loads(6, 4, 2), PREFIX)] == ["ns/pod-b", "ns/pod-c"]


def test_kv_nearly_full_is_skipped_while_another_has_room() -> None:
    assert [r.name for r in eligible(loads(0, 0, 0, kv=(0.99, 0.5, None)), PREFIX)] == ["ns/pod-b", "ns/pod-c"]
    assert len(eligible(loads(0, 0, kv=(0.99, 0.99)), PREFIX)) == 2  # all full: all stay


def test_ring_order_does_not_depend_on_the_order_replicas_are_listed() -> None:
    r1, r2 = HashRing(NAMES), HashRing(list(reversed(NAMES)))
    for key in (1, 2**40, 2**63, 12345678901234567):
        assert list(r1.walk(key)) == list(r2.walk(key))
        assert sorted(r1.walk(key)) == sorted(NAMES)


def test_ring_spreads_keys_over_replicas() -> None:
    ring = HashRing(NAMES)
    counts = {n: 0 for n in NAMES}
    for key in range(0, 2**64, 2**64 // 3000):
        counts[next(ring.walk(key))] += 1
    assert min(counts.values()) > 600  # each of 3 gets at least 20% of 3000 keys


def test_a_new_prefix_goes_to_its_ring_home_and_a_hot_home_spills_to_its_successor() -> None:
    ring = HashRing(NAMES)
    key = 987654321
    home, successor = list(ring.walk(key))[:2]
    idle = [ReplicaLoad(n) for n in NAMES]
    assert choose(idle, [key], {}, ring, PREFIX) == choose(idle, [key], {}, ring, PREFIX)
    first = choose(idle, [key], {}, ring, PREFIX)
    assert (first.replica, first.rule) == (home, "ring")
    hot = [ReplicaLoad(n, inflight=5 if n == home else 1) for n in NAMES]  # bound: ceil(1.25 * 8 / 3) = 4
    assert choose(hot, [key], {}, ring, PREFIX).replica == successor


def test_the_longest_cached_prefix_wins_among_replicas_under_the_bound() -> None:
    ring = HashRing(NAMES)
    idle = [ReplicaLoad(n) for n in NAMES]
    choice = choose(idle, [11, 22, 33], {"ns/pod-a": 1, "ns/pod-c": 3}, ring, PREFIX)
    assert (choice.replica, choice.rule, choice.matched_blocks) == ("ns/pod-c", "prefix", 3)
    busy_c = [ReplicaLoad(n, inflight=6 if n == "ns/pod-c" else 0) for n in NAMES]  # bound ceil(1.25*7/3) = 3
    assert choose(busy_c, [11, 22, 33], {"ns/pod-a": 1, "ns/pod-c": 3}, ring, PREFIX).replica == "ns/pod-a"


def test_a_short_prompt_goes_to_the_least_loaded() -> None:
    ring = HashRing(NAMES)
    replicas = [ReplicaLoad("ns/pod-a", 2), ReplicaLoad("ns/pod-b", 0, others=1.0), ReplicaLoad("ns/pod-c", 1,
                                                                                               kv_usage=0.1)]
    choice = choose(replicas, [], {}, ring, PREFIX)
    assert (choice.replica, choice.rule) == ("ns/pod-b", "least_load")  # load 1, kv unknown (0) beats kv 0.1


def test_round_robin_cycles_and_ignores_prompts() -> None:
    ring = HashRing(NAMES)
    rr = RoutingConfig(policy="round-robin")
    idle = [ReplicaLoad(n) for n in NAMES]
    picks = [choose(idle, [7], {"ns/pod-a": 9}, ring, rr, turn=t).replica for t in range(6)]
    assert picks == NAMES * 2


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="load factor"):
        RoutingConfig(load_factor=0.5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.lists(st.integers(0, 2**64 - 1), max_size=4),
       st.dictionaries(st.sampled_from([f"r{i}" for i in range(6)]), st.integers(0, 4)))
def test_the_choice_is_always_under_the_bound(inflight: list[int], hashes: list[int], matches: dict[str, int]) -> None:
    replicas = [ReplicaLoad(f"r{i}", v) for i, v in enumerate(inflight)]
    ring = HashRing([r.name for r in replicas])
    choice = choose(replicas, hashes, matches, ring, PREFIX)
    bound = load_bound([r.load for r in replicas], PREFIX.load_factor)
    assert next(r for r in replicas if r.name == choice.replica).load < bound
