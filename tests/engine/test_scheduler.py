"""The scheduler driven with hand-built model outputs: exact block ids, budgets, preemption, priority."""

from __future__ import annotations

from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

BS = 4
EOS = 0


def make_sched(num_blocks: int = 16, budget: int = 64, max_seqs: int = 8, chunked: bool = True,
               caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, max_seqs, budget, max_model_len=64, enable_chunked_prefill=chunked)


def req(rid: str, n: int, max_tokens: int = 8, priority: int = 0, arrival: float = 0.0,
        first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), max_tokens=max_tokens, stop_token_ids=frozenset({EOS}),
                   priority=priority, arrival_time=arrival)


def run_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    out = s.schedule()
    result = ModelRunnerOutput({x.request_id: token for x in out.scheduled if x.needs_sample})
    return out, s.update_from_output(out, result)


def test_prefill_then_decode_with_exact_blocks() -> None:
    s = make_sched()
    a, b = req("a", 6), req("b", 3, first=50)
    s.add_request(a)
    s.add_request(b)
    out, _ = run_step(s)
    assert [(x.request_id, x.start, x.num_new_tokens, x.block_ids) for x in out.scheduled] == [
        ("a", 0, 6, [0, 1]), ("b", 0, 3, [2])]
    assert all(x.needs_sample for x in out.scheduled)
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    out, _ = run_step(s)   # decodes: a writes position 6 (block 1), b position 3 (block 2)
    assert [(x.request_id, x.start, x.num_new_tokens, x.block_ids) for x in out.scheduled] == [
        ("a", 6, 1, [0, 1]), ("b", 3, 1, [2])]
    out, _ = run_step(s)   # a: position 7 still block 1; b: position 4 needs a new block
    assert [x.block_ids for x in out.scheduled] == [[0, 1], [2, 3]]
    s.kv.check_invariants()


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    s = make_sched(budget=8)
    a = req("a", 3)
    s.add_request(a)
    run_step(s)                       # a prefilled, now decoding
    long = req("long", 20, first=30)
    s.add_request(long)
    chunks = []
    while not long.is_prefill_done:
        out, _ = run_step(s)
        assert out.num_batched_tokens <= 8
        assert out.scheduled[0].request_id == "a" and out.scheduled[0].num_new_tokens == 1
        chunks.append([(x.start, x.num_new_tokens) for x in out.scheduled if x.request_id == "long"][0])
    assert chunks == [(0, 7), (7, 7), (14, 6)]
    assert long.output_token_ids == [7]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make_sched(budget=10, chunked=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 6, first=20))
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["a"]      # b does not fit the rest of the budget
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 6)]


def test_max_num_seqs_limits_running() -> None:
    s = make_sched(max_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, first=10 * i + 1))
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["r0", "r1"] and len(s.waiting) == 1


def test_preemption_frees_latest_arrival_and_recomputes() -> None:
    s = make_sched(num_blocks=4, budget=64, caching=False)
    a, b = req("a", 4, max_tokens=8, arrival=1.0), req("b", 4, max_tokens=8, first=20, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    run_step(s)                       # a: [0], b: [1]; both decoding
    run_step(s)                       # position 4: a gets [0, 2], b gets [1, 3]
    assert s.kv.get_block_ids(a) == [0, 2] and s.kv.get_block_ids(b) == [1, 3]
    for _ in range(3):
        run_step(s)                   # positions 5..7 fit
    out, _ = run_step(s)              # position 8: no block left -> b (latest) is preempted
    assert out.preempted_req_ids == ["b"] and s.num_preemptions == 1
    assert [x.request_id for x in out.scheduled] == ["a"] and s.kv.get_block_ids(a) == [0, 2, 3]   # b freed tail first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting == [b]
    while not a.is_finished:
        run_step(s)
    assert len(a.output_token_ids) == 8 and a.status == RequestStatus.FINISHED_LENGTH
    out, _ = run_step(s)              # b comes back: recomputes its prompt and outputs so far
    assert out.scheduled[0].request_id == "b" and out.scheduled[0].start == 0
    assert out.scheduled[0].num_new_tokens == 4 + 5      # prompt + the 5 tokens it had
    while s.has_unfinished():
        run_step(s)
    assert len(b.output_token_ids) == 8
    assert s.kv.pool.num_used_blocks == 0
    s.kv.check_invariants()


def test_priority_orders_waiting_and_picks_victims() -> None:
    s = make_sched(max_seqs=1)
    s.add_request(req("low", 2, priority=5, arrival=0.0))
    s.add_request(req("high", 2, priority=-1, arrival=1.0, first=10))
    out, _ = run_step(s)
    assert [x.request_id for x in out.scheduled] == ["high"]


def test_stop_token_min_tokens_and_max_tokens() -> None:
    s = make_sched()
    a = Request("a", [1, 2], max_tokens=5, min_tokens=2, stop_token_ids=frozenset({EOS}))
    s.add_request(a)
    run_step(s, token=EOS)            # below min_tokens: eos does not stop
    assert not a.is_finished
    _, ups = run_step(s, token=EOS)
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == EOS and ups[0].finished
    b = Request("b", [3], max_tokens=2)
    s.add_request(b)
    run_step(s)
    run_step(s)
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [7, 7]
    assert s.kv.pool.num_used_blocks == 0


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    s = make_sched()
    a = req("a", 9, max_tokens=1)
    s.add_request(a)
    run_step(s)                       # a finishes after one token; its 2 full blocks stay cached
    assert a.is_finished and s.kv.pool.num_cached_free_blocks == 2
    b = req("b", 10, max_tokens=1)    # same first 9 tokens
    s.add_request(b)
    out, _ = run_step(s)
    x = out.scheduled[0]
    assert (x.start, x.num_new_tokens, x.block_ids[:2]) == (8, 2, [0, 1])
    assert b.num_cached_tokens == 8 and s.kv.prefix_cache_hits == 8


def test_fork_shares_blocks_then_copy_on_write() -> None:
    s = make_sched(caching=False)
    p = Request("p#0", [1, 2, 3, 4, 5, 6], max_tokens=4, compute_limit=5)
    s.add_request(p)
    _, ups = run_step(s)
    assert ups[0].new_token_id is None and p.num_computed_tokens == 5     # ready to fork
    p.compute_limit = None
    c = s.fork(p, "p#1", 1)
    c.compute_limit = None
    assert s.kv.get_block_ids(c) == s.kv.get_block_ids(p) == [0, 1]
    out, _ = run_step(s)              # both write position 5 in shared block 1: one copy
    assert out.copy_pairs == [(1, 2)]
    assert [x.block_ids for x in out.scheduled] == [[0, 2], [0, 1]]   # the first writer copies
    s.kv.check_invariants()


def test_abort_frees_at_once() -> None:
    s = make_sched()
    a = req("a", 10)
    s.add_request(a)
    run_step(s)
    assert s.kv.pool.num_used_blocks == 3
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished()


# --- property test: random traffic through a tiny pool ------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8), st.integers(0, 2), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=120, deadline=None)
@given(st.lists(_op, max_size=40), st.integers(8, 14), st.booleans(), st.booleans(), st.integers(4, 40))
def test_random_traffic_keeps_invariants_and_frees_everything(ops, num_blocks, chunked, caching, budget) -> None:
    s = Scheduler(KVCacheManager(num_blocks, BS, caching), max_num_seqs=4,
                  max_num_batched_tokens=budget if chunked else 64, max_model_len=64,
                  enable_chunked_prefill=chunked)
    live: list[Request] = []
    counter = 0

    def step(tok: int) -> None:
        out = s.schedule()
        res = ModelRunnerOutput({x.request_id: tok for x in out.scheduled if x.needs_sample})
        for up in s.update_from_output(out, res):
            r = up.request
            if up.new_token_id is None and r.compute_limit is not None:   # fork point (n > 1)
                r.compute_limit = None
                for i in range(1, r.index + 2):
                    c = s.fork(r, f"{r.request_id}.{i}", i)
                    c.compute_limit = None
                    live.append(c)
        s.check_invariants()

    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, prio, samples = op
            counter += 1
            n = min(n, num_blocks * BS - max_tokens)      # each sequence alone fits the pool
            toks = [(counter * 7 + i) % 3 + 1 for i in range(n)]   # small alphabet: prefix hits
            r = Request(f"r{counter}", toks, max_tokens=max_tokens, stop_token_ids=frozenset({EOS}),
                        priority=prio, compute_limit=n - 1 if samples > 1 and n > 1 else None,
                        index=samples - 2 if samples > 1 else 0)
            s.add_request(r)
            live.append(r)
        elif op[0] == "step":
            step(op[1])
        elif live:
            victim = live[op[1] % len(live)]
            s.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            s.check_invariants()
    for _ in range(2000):
        if not s.has_unfinished():
            break
        step(5)
    assert not s.has_unfinished(), "requests starved"
    assert all(r.is_finished for r in live)
    assert s.kv.pool.num_used_blocks == 0
    s.kv.check_invariants()
