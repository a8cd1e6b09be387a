"""The block pool and KV cache manager: allocation, prefix cache, fork, copy-on-write, invariants."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request

BS = 4


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, max_tokens=100, cache_salt=salt)


def compute(kv: KVCacheManager, req: Request, n: int, hits: list[int] | None = None) -> bool:
    """Allocate for n new tokens and mark them computed (what one scheduler step does)."""
    ok = kv.allocate_slots(req, n, hits)
    if ok:
        req.num_computed_tokens += n + len(hits or []) * kv.block_size
        kv.cache_full_blocks(req)
    return ok


def test_core_never_imports_torch() -> None:
    code = ("import sys; import kvfleet.engine.core, kvfleet.engine.core.scheduler, "
            "kvfleet.engine.core.beam_search, kvfleet.engine.core.detokenizer, kvfleet.engine.core.inputs, "
            "kvfleet.engine.core.request_group, kvfleet.engine.sampling_params, kvfleet.engine.outputs; "
            "assert 'torch' not in sys.modules, 'core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_on_demand_and_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    req = make_req("a", list(range(10)))
    assert compute(kv, req, 10)
    assert kv.get_block_ids(req) == [0, 1, 2]
    req.append_output_token(99)
    req.append_output_token(98)        # 12 tokens: still 3 blocks
    assert compute(kv, req, 2)
    assert kv.get_block_ids(req) == [0, 1, 2]
    req.append_output_token(97)        # the 13th token needs a 4th block
    assert compute(kv, req, 1)
    assert kv.get_block_ids(req) == [0, 1, 2, 3]
    assert kv.pool.num_used_blocks == 4
    kv.free(req)
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_allocation_fails_cleanly_when_short() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    req = make_req("a", list(range(9)))
    assert not kv.allocate_slots(req, 9)
    assert kv.pool.num_free_blocks == 2 and kv.get_block_ids(req) == []
    kv.check_invariants()


def test_prefix_cache_hit_confirmed_and_lru_eviction() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_req("a", list(range(10)))                 # 2 full blocks + 2 tokens
    assert compute(kv, a, 10)
    kv.free(a)
    assert kv.pool.num_cached_free_blocks == 2          # the 2 full blocks stay cached
    b = make_req("b", list(range(8)) + [50, 51, 52])
    hits, n = kv.get_computed_blocks(b)
    assert hits == [0, 1] and n == 8
    assert compute(kv, b, 3, hits)
    assert kv.get_block_ids(b)[:2] == [0, 1] and kv.pool.ref_cnt[0] == 1
    # Same tokens under another salt: no hit.
    c = make_req("c", list(range(10)), salt="tenant-2")
    assert kv.get_computed_blocks(c) == ([], 0)
    # A whole-prompt hit stops one token short, so the last token is computed.
    d = make_req("d", list(range(8)))
    hits, n = kv.get_computed_blocks(d)
    assert hits == [0] and n == 4
    kv.free(b)
    # Eviction: free (uncached) blocks go first, then the least recently used cached ones.
    e = make_req("e", list(range(100, 124)))
    assert compute(kv, e, 24)
    assert kv.pool.num_cached_free_blocks == 0
    assert kv.get_computed_blocks(make_req("f", list(range(10)))) == ([], 0)
    kv.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_records_pairs() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    parent = make_req("p", list(range(6)))             # 1 full + 1 partial block
    assert compute(kv, parent, 6)
    parent.append_output_token(7)
    child = parent.fork("c", 1)
    kv.fork(parent, child)
    assert kv.get_block_ids(child) == kv.get_block_ids(parent) == [0, 1]
    assert kv.pool.ref_cnt[0] == 2 and kv.pool.ref_cnt[1] == 2
    assert compute(kv, child, 1)                       # writes position 6 in shared block 1
    assert kv.get_block_ids(child) == [0, 2]
    assert kv.take_copies() == [(1, 2)]
    assert compute(kv, parent, 1)                      # now the only holder: writes in place
    assert kv.get_block_ids(parent) == [0, 1]
    assert kv.take_copies() == []
    kv.check_invariants()
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_used_blocks == 0
    kv.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "evict"]),
                          st.integers(0, 7), st.integers(1, 9)), max_size=60),
       st.booleans())
def test_random_operations_keep_refcounts_and_free_list_consistent(ops, caching) -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=caching)
    live: list[Request] = []
    counter = 0
    for op, pick, size in ops:
        if op == "new" or not live:
            counter += 1
            req = make_req(f"r{counter}", [(pick + i) % 5 for i in range(size)])
            hits, _ = kv.get_computed_blocks(req)
            if compute(kv, req, req.num_tokens - len(hits) * BS, hits):
                live.append(req)
        elif op == "append":
            req = live[pick % len(live)]
            for i in range(size):
                req.append_output_token((pick * i) % 5)
            if not compute(kv, req, size):
                kv.free(req)
                live.remove(req)
        elif op == "fork":
            counter += 1
            parent = live[pick % len(live)]
            child = parent.fork(f"r{counter}", 1)
            kv.fork(parent, child)
            live.append(child)
        elif op == "free":
            req = live.pop(pick % len(live))
            kv.free(req)
        elif op == "evict":
            kv.reset_prefix_cache()
        kv.take_copies()
        kv.check_invariants()
        used = {b for r in live for b in kv.get_block_ids(r)}
        assert kv.pool.num_used_blocks == len(used)
    for req in live:
        kv.free(req)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0


def test_block_pool_double_free_is_caught() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.decref(b)
    try:
        pool.decref(b)
    except AssertionError as e:
        assert "freed twice" in str(e)
    else:
        raise AssertionError("double free went unnoticed")
