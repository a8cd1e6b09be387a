"""Which replica takes a request (pure): prefix-aware with bounded load, plus load-aware.

Load of a replica = the gateway's own requests in flight there + the requests others had there at the
engine's last scrape (its waiting + running, minus what this gateway had in flight when it was read),
so the number is live for our traffic and seconds old only for other clients and gateway replicas.

Policy `prefix` (the default), in order:
1. **Bounded load** (Mirrokni et al.; KubeAI's CHWBL): with total load L over n replicas, a replica may
   take the request only while its load is below ceil(c * (L + 1) / n), c = `load_factor` (1.25). A
   replica whose KV cache is over `kv_high` is skipped too, unless every one under the bound is.
2. **Longest cached prefix** (llm-d's prefix scorer): among those, the replica to which this gateway
   last sent the longest run of the prompt's leading blocks (at least `min_match_blocks`) takes it;
   ties go to the earlier one on the ring.
3. **Consistent hashing**: a prompt with at least one full block whose prefix no eligible replica
   holds goes to the first eligible replica clockwise on the ring from its first block's hash. Every
   gateway replica computes the same ring from the same pod names, so they agree where a new prefix
   lives, and a hot prefix spills to the same successor.
4. **Least load**: a prompt shorter than a block goes to the eligible replica with the least load,
   then the least KV-cache use.

Policy `round-robin` ignores prompts and load (the baseline of the benchmark); `least-load` is rule 4
for every request.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

POLICIES = ("prefix", "round-robin", "least-load")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "prefix"
    load_factor: float = 1.25
    kv_high: float = 0.95
    min_match_blocks: int = 1
    virtual_nodes: int = 100

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.load_factor >= 1.0:
            raise ValueError(f"load factor must be >= 1, got {self.load_factor}")


@dataclass(frozen=True)
class ReplicaLoad:
    name: str
    inflight: int = 0  # this gateway's requests there now
    others: float = 0.0  # other clients' requests there at the last scrape
    kv_usage: float | None = None  # 0..1 at the last scrape; None if unknown

    @property
    def load(self) -> float:
        return self.inflight + self.others


@dataclass(frozen=True)
class Choice:
    replica: str
    rule: str  # prefix | ring | least_load | round_robin
    matched_blocks: int = 0


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class HashRing:
    """Replicas on a 64-bit ring, `virtual_nodes` points each; immutable."""

    def __init__(self, names: Sequence[str], virtual_nodes: int = 100) -> None:
        points = sorted((_point(f"{name}#{i}"), name) for name in set(names) for i in range(virtual_nodes))
        self._keys = [p for p, _ in points]
        self._names = [n for _, n in points]
        self.members = frozenset(names)

    def walk(self, key: int) -> Iterator[str]:
        """Each replica once, clockwise from `key`."""
        if not self._keys:
            return
        start = bisect.bisect_left(self._keys, key)
        seen: set[str] = set()
        for i in range(len(self._keys)):
            name = self._names[(start + i) % len(self._keys)]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.members):
                    return


def load_bound(loads: Sequence[float], load_factor: float) -> float:
    """ceil(c * (L + 1) / n): the most a replica may hold, counting the request being placed."""
    return math.ceil(load_factor * (sum(loads) + 1) / len(loads))


def eligible(replicas: Sequence[ReplicaLoad], cfg: RoutingConfig) -> list[ReplicaLoad]:
    """Replicas under the load bound, without those whose KV cache is nearly full when others are not."""
    bound = load_bound([r.load for r in replicas], cfg.load_factor)
    under = [r for r in replicas if r.load < bound] or list(replicas)
    roomy = [r for r in under if r.kv_usage is None or r.kv_usage < cfg.kv_high]
    return roomy or under


def least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    return min(replicas, key=lambda r: (r.load, r.kv_usage or 0.0, r.name))


def choose(replicas: Sequence[ReplicaLoad], hashes: Sequence[int], matches: Mapping[str, int], ring: HashRing,
           cfg: RoutingConfig, turn: int = 0) -> Choice:
    """The replica for one request. `matches`: replica -> leading blocks of `hashes` it holds (from the
    prefix index); `turn`: a counter the caller advances, for round-robin. `replicas` is not empty."""
    if not replicas:
        raise ValueError("no replica to choose from")
    if cfg.policy == "round-robin":
        ordered = sorted(replicas, key=lambda r: r.name)
        return Choice(ordered[turn % len(ordered)].name, "round_robin")
    pool = eligible(replicas, cfg)
    if cfg.policy == "least-load" or not hashes:
        return Choice(least_loaded(pool).name, "least_load")
    names = {r.name for r in pool}
    order = {name: i for i, name in enumerate(n for n in ring.walk(hashes[0]) if n in names)}
    best = max(pool, key=lambda r: (matches.get(r.name, 0), -order.get(r.name, len(order))))
    matched = matches.get(best.name, 0)
    if matched >= cfg.min_match_blocks:
        return Choice(best.name, "prefix", matched)
    for name in ring.walk(hashes[0]):
        if name in names:
            return Choice(name, "ring")
    return Choice(least_loaded(pool).name, "least_load")  # replicas not on the ring (it lags a change)
