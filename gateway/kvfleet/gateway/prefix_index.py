"""Which prompt blocks this gateway sent to which replica: an approximation of each engine's prefix cache.

Per replica, an LRU of block hashes with a fixed capacity (the engine evicts its cached blocks LRU too;
the index forgets the oldest first). Engines' caches are salted per tenant and a model belongs to one
tenant, so one index per model is exact about who may share what.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 16384) -> None:
        self.capacity = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def match(self, replica: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` were sent to `replica` (and not forgotten since)."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def matches(self, replicas: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        return {r: self.match(r, hashes) for r in replicas} if hashes else {}

    def record(self, replica: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        held = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone (a new pod starts with an empty cache)."""
        live = set(replicas)
        for name in [n for n in self._blocks if n not in live]:
            del self._blocks[name]
