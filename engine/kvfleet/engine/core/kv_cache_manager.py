"""Block tables over the `BlockPool`: on-demand allocation, prefix caching, fork and copy-on-write.

- Each sequence has a block table (logical block i -> physical block id); blocks are
  taken as tokens are appended and returned when the sequence is freed.
- Prefix caching: a full block is identified by a chained hash (its parent's hash,
  an optional per-request salt for the first block, its token ids). A hit is
  confirmed by comparing the token ids, so a hash collision can never mix contexts.
- Fork (n > 1, beam search): the child gets the parent's table, every block's
  reference count goes up.
- Copy-on-write: before a sequence writes into a block that others also hold, it
  gets a new block; the pair (src, dst) is recorded for the runner to copy first.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from typing import Optional

from kvfleet.engine.core.block_pool import BlockHash, BlockPool
from kvfleet.engine.core.request import Request

logger = logging.getLogger(__name__)


def hash_block(parent: Optional[BlockHash], tokens: tuple[int, ...], salt: Optional[str]) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent or b"root")
    if parent is None and salt:
        h.update(b"salt:" + salt.encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}       # hashes of each request's full blocks
        self._num_registered: dict[str, int] = {}           # how many of its blocks were offered to the cache
        self._pending_copies: list[tuple[int, int]] = []
        # Lowest block-table index changed since `take_changed` last saw the request (the model
        # runner keeps persistent block tables and rewrites only from there).
        self._changed_from: dict[str, int] = {}
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    # --- hashing -------------------------------------------------------------------
    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        toks = req.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(toks[i * bs:(i + 1) * bs]), req.cache_salt))
        return hashes

    # --- prefix cache lookup ---------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks of the longest cached prefix of `req` and how many tokens they hold.

        At most `num_tokens - 1` tokens hit, so the last token is always computed (its
        logits are needed) and a hit block is never written to.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self._block_hashes(req, max_blocks)
        toks = req.all_token_ids
        hits: list[int] = []
        for i in range(max_blocks):
            bid = self.pool.lookup(hashes[i], tuple(toks[i * bs:(i + 1) * bs]))
            if bid is None:
                break
            hits.append(bid)
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # --- allocation ----------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int,
                      computed_blocks: Optional[list[int]] = None) -> int:
        """Free blocks that `allocate_slots` would take (new blocks, a CoW copy, revived cached blocks)."""
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(req.request_id, [])
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(computed_blocks) * bs
        total_blocks = _cdiv(num_computed + num_new_tokens, bs)
        need = max(0, total_blocks - len(table) - len(computed_blocks))
        if num_new_tokens > 0 and num_computed % bs != 0:
            idx = num_computed // bs
            if idx < len(table) and self.pool.ref_cnt[table[idx]] > 1:
                need += 1   # copy-on-write of the partly filled shared block
        # Taking a cached-free block back removes it from what is allocatable.
        need += sum(1 for b in computed_blocks if self.pool.is_evictable(b))
        return need

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: Optional[list[int]] = None) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones.

        `computed_blocks` (prefix-cache hits, only before the first allocation) join the
        front of its table. Returns False, changing nothing, when the pool is short.
        """
        if not computed_blocks:
            # Fast path (most decode steps): the new tokens fit the blocks it holds and the block
            # written is its own, so nothing would change (same answer as the general path below).
            held = self.block_tables.get(req.request_id)
            if held is not None:
                bs = self.block_size
                num_computed = req.num_computed_tokens
                if num_computed + num_new_tokens <= len(held) * bs and (
                        num_new_tokens <= 0 or num_computed % bs == 0
                        or self.pool.ref_cnt[held[num_computed // bs]] == 1):
                    return True
        computed_blocks = computed_blocks or []
        if self.blocks_needed(req, num_new_tokens, computed_blocks) > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(req.request_id, [])
        self._mark_changed(req.request_id, len(table))
        assert not computed_blocks or not table, "prefix hits only for a fresh table"
        for bid in computed_blocks:
            self.pool.incref(bid)
        table.extend(computed_blocks)
        if computed_blocks:
            self._num_registered[req.request_id] = len(computed_blocks)
        bs = self.block_size
        num_computed = req.num_computed_tokens + len(computed_blocks) * bs
        if num_new_tokens > 0 and num_computed % bs != 0:
            idx = num_computed // bs
            src = table[idx]
            if self.pool.ref_cnt[src] > 1:
                dst = self.pool.allocate(1)[0]
                self._pending_copies.append((src, dst))
                self.pool.decref(src)
                table[idx] = dst
                self._mark_changed(req.request_id, idx)
        total_blocks = _cdiv(num_computed + num_new_tokens, bs)
        if total_blocks > len(table):
            table.extend(self.pool.allocate(total_blocks - len(table)))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Offer the blocks that became full (all tokens computed) to the prefix cache."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(req.request_id)
        if not table:
            return
        bs = self.block_size
        # Never past the tokens whose ids are known (async scheduling computes placeholders ahead).
        num_full = min(min(req.num_computed_tokens, req.num_tokens) // bs, len(table))
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return   # most steps: no block became full
        hashes = self._block_hashes(req, num_full)
        toks = req.all_token_ids
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i], tuple(toks[i * bs:(i + 1) * bs]))
        self._num_registered[req.request_id] = num_full

    def _mark_changed(self, request_id: str, index: int) -> None:
        cur = self._changed_from.get(request_id)
        if cur is None or index < cur:
            self._changed_from[request_id] = index

    def take_changed(self, req: Request) -> int:
        """First index of `req`'s block table changed since the last call (its length if none)."""
        cf = self._changed_from.pop(req.request_id, None)
        return len(self.block_tables.get(req.request_id, ())) if cf is None else cf

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must do before this step's forward."""
        out, self._pending_copies = self._pending_copies, []
        return out

    # --- fork / free ---------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        table = self.block_tables.get(parent.request_id, [])
        for bid in table:
            self.pool.incref(bid)
        self.block_tables[child.request_id] = list(table)
        self._changed_from[child.request_id] = 0
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_registered[child.request_id] = self._num_registered.get(parent.request_id, 0)

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks; tail first, so the tail is evicted first."""
        table = self.block_tables.pop(req.request_id, [])
        for bid in reversed(table):
            self.pool.decref(bid)
        self._changed_from.pop(req.request_id, None)   # a later table is a new one (marked from 0)
        self._hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.pool.evict()

    # --- introspection -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_block_ids(self, req: Request) -> list[int]:
        return self.block_tables.get(req.request_id, [])

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for bid in table:
                counts[bid] += 1
        assert counts == self.pool.ref_cnt, "reference counts differ from the block tables"
        assert set(self._changed_from) <= set(self.block_tables), "change marks of freed tables"
