"""The runner's one-pass step inputs and persistent block tables equal the plain-list metadata builder."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvfleet.engine.attention.metadata import build_attention_metadata
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request
from kvfleet.engine.core.scheduler import ModelRunnerOutput, Scheduler
from kvfleet.engine.step_inputs import BlockTableRows, build_step_inputs

BS = 4


@pytest.mark.parametrize("seed", range(5))
def test_scheduler_driven_inputs_match_the_metadata_builder(seed: int) -> None:
    """Prefill chunks, decodes, preemptions (small pool), forks with copy-on-write, finishes."""
    rnd = random.Random(seed)
    kv = KVCacheManager(24, BS, enable_caching=True)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=64)
    rows = BlockTableRows(max_blocks=2, rows=2)   # small: rows and columns must grow
    live: list[Request] = []
    copies = 0
    for i in range(60):
        if rnd.random() < 0.3 or not sched.has_unfinished():
            n = rnd.randint(1, 20)
            r = Request(f"r{i}", [rnd.randrange(50) for _ in range(n)], max_tokens=rnd.randint(1, 12))
            sched.add_request(r)
            live.append(r)
        if rnd.random() < 0.2:
            parents = [r for r in sched.running if r.is_prefill_done]   # both then write one block: CoW
            if parents:
                live.append(sched.fork(rnd.choice(parents), f"f{i}", 1))
        out = sched.schedule()
        copies += len(out.copy_pairs)
        if out.is_empty:
            continue
        sc = out.scheduled
        inp = build_step_inputs(sc, BS, rows)
        md = build_attention_metadata([s.num_new_tokens for s in sc], [s.start + s.num_new_tokens for s in sc],
                                      [s.block_ids for s in sc], BS)
        assert inp.slot_mapping == md.slot_mapping.tolist()
        assert inp.query_start_loc == md.query_start_loc_cpu and inp.seq_lens == md.seq_lens_cpu
        assert inp.max_query_len == md.max_query_len
        np.testing.assert_array_equal(inp.block_tables, md.block_tables.numpy())
        assert inp.input_ids == [t for s in sc for t in s.token_ids]
        assert inp.positions == [p for s in sc for p in range(s.start, s.start + s.num_new_tokens)]
        result = ModelRunnerOutput({s.request_id: rnd.randrange(50) for s in sc if s.needs_sample})
        for upd in sched.update_from_output(out, result):
            if upd.finished:
                rows.release(upd.request.request_id)
        sched.check_invariants()
    assert copies, "no copy-on-write was exercised"
    assert len(rows.row_of) <= len(live)


def test_rows_rewrite_only_what_changed_and_pad_with_zero() -> None:
    rows = BlockTableRows(max_blocks=3, rows=1)
    r = rows.update("a", [5, 6], changed_from=0)
    rows.update("a", [5, 6, 7, 8], changed_from=2)            # appended, columns grow
    rows.update("a", [5, 9, 7, 8], changed_from=1)            # copy-on-write at index 1
    rows.update("b", [1], changed_from=0)                     # rows grow
    np.testing.assert_array_equal(rows.gather([r, rows.row_of["b"]], 4), [[5, 9, 7, 8], [1, 0, 0, 0]])
    rows.update("a", [3], changed_from=0)                     # a new, shorter table (after preemption)
    np.testing.assert_array_equal(rows.gather([r], 4), [[3, 0, 0, 0]])
    rows.release("a")
    rows.update("c", [2, 2], changed_from=5)                  # a reused row is written whole
    np.testing.assert_array_equal(rows.gather([rows.row_of["c"]], 3), [[2, 2, 0]])

