"""The physical pool of KV blocks: reference counts, a free list, and the prefix cache.

A block is in exactly one of three states:
- used: `ref_cnt > 0` (in some sequence's block table);
- cached-free: `ref_cnt == 0` and it holds the hash of a full block, kept in an LRU
  so a later request with the same prefix can take it back;
- free: `ref_cnt == 0`, no hash, on the free list.
Allocation takes free blocks first and evicts the least recently used cached-free
block only when the free list is empty (lazy eviction).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional

BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[Optional[BlockHash]] = [None] * num_blocks
        self.block_tokens: list[Optional[tuple[int, ...]]] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # LRU first
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    # --- counts --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-free)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    # --- allocation ----------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        assert count <= self.num_free_blocks, f"asked for {count} blocks, {self.num_free_blocks} free"
        out: list[int] = []
        for _ in range(count):
            if self._free:
                bid = self._free.popleft()
            else:
                bid, _ = self._evictable.popitem(last=False)
                self._uncache(bid)
                self.num_evictions += 1
            assert self.ref_cnt[bid] == 0
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def incref(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            # Only a cached block can be taken back from the free side.
            assert block_id in self._evictable, f"block {block_id} is free and uncached"
            del self._evictable[block_id]
        self.ref_cnt[block_id] += 1

    def decref(self, block_id: int) -> None:
        assert self.ref_cnt[block_id] > 0, f"block {block_id} freed twice"
        self.ref_cnt[block_id] -= 1
        if self.ref_cnt[block_id] == 0:
            if self.block_hash[block_id] is not None:
                self._evictable[block_id] = None   # most recently used end
            else:
                self._free.append(block_id)

    # --- prefix cache --------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> Optional[int]:
        """The cached block holding exactly `tokens` under `block_hash`, if any."""
        bid = self._cached.get(block_hash)
        if bid is None or self.block_tokens[bid] != tokens:
            return None
        return bid

    def cache(self, block_id: int, block_hash: BlockHash, tokens: tuple[int, ...]) -> bool:
        """Register a full, used block under its hash; False if that hash is already cached."""
        assert self.ref_cnt[block_id] > 0
        if self.block_hash[block_id] is not None or block_hash in self._cached:
            return False
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tokens
        self._cached[block_hash] = block_id
        return True

    def _uncache(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self._cached[h]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def evict(self, count: Optional[int] = None) -> int:
        """Drop up to `count` (default all) least recently used cached-free blocks."""
        n = len(self._evictable) if count is None else min(count, len(self._evictable))
        for _ in range(n):
            bid, _ = self._evictable.popitem(last=False)
            self._uncache(bid)
            self._free.append(bid)
            self.num_evictions += 1
        return n

    # --- invariants ----------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "duplicate block on the free list"
        assert not (free & evictable), "block both free and cached-free"
        for bid in range(self.num_blocks):
            rc = self.ref_cnt[bid]
            assert rc >= 0
            if rc > 0:
                assert bid not in free and bid not in evictable, f"used block {bid} on a free list"
            else:
                assert (bid in free) != (bid in evictable), f"unused block {bid} lost"
                assert (self.block_hash[bid] is not None) == (bid in evictable)
            h = self.block_hash[bid]
            if h is not None:
                assert self._cached.get(h) == bid, f"block {bid} hash not indexed"
        assert len(self._cached) == sum(h is not None for h in self.block_hash)
