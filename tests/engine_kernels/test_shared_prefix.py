"""The shared-prefix pass of decode attention (cascade attention): its plan, and the kernels against the
reference op on steps whose sequences share KV blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention, triton_backend
from kvfleet.engine.attention import shared_prefix as sp
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_backend import triton_paged_attention
from kvfleet.engine.kernels import shared_prefix as kernel
from kvfleet.engine.kernels.paged_decode import SharedPrefixArgs, paged_attention_ref, paged_decode_attention

from .paged import rel_err


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    return np.array([r + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def test_plan_groups_rows_by_their_leading_blocks() -> None:
    tables = _tables([[10, 11, 12, 13, 1], [20, 21, 2], [10, 11, 12, 13, 3, 4], [20, 21, 5],
                      [10, 11, 12, 13, 6], [30, 31, 32, 7]])
    seq_lens = np.array([20, 12, 24, 12, 18, 16])
    plan = sp.plan_shared_prefixes(tables, seq_lens, np.ones(6, dtype=bool), 4, members_per_item=8, min_tokens=8)
    assert plan is not None
    assert plan.kv_start.tolist() == [16, 8, 16, 8, 16, 0]
    groups = {tuple(sorted(plan.members[a:a + c].tolist())): (rep, tokens)
              for rep, tokens, a, c in plan.items.tolist()}
    assert set(groups) == {(0, 2, 4), (1, 3)}
    assert groups[(0, 2, 4)][1] == 16 and groups[(0, 2, 4)][0] in (0, 2, 4)
    assert groups[(1, 3)][1] == 8


def test_plan_keeps_every_member_s_newest_token_out_and_skips_prefill_rows() -> None:
    # three rows share blocks 1..3, but one of them is only 9 tokens long: 2 full blocks before its newest token
    tables = _tables([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3], [1, 2, 3, 6]])
    seq_lens = np.array([16, 16, 9, 16])
    decode = np.array([True, True, True, False])
    plan = sp.plan_shared_prefixes(tables, seq_lens, decode, 4, members_per_item=8, min_tokens=4)
    assert plan is not None and plan.kv_start.tolist() == [8, 8, 8, 0]
    assert sorted(plan.members.tolist()) == [0, 1, 2]


def test_plan_splits_groups_into_items_and_keeps_the_largest_groups() -> None:
    rows = [[1, 2, 3, 10 + i] for i in range(5)] + [[4, 5, 6, 20 + i] for i in range(2)]
    tables, seq_lens = _tables(rows), np.full(7, 14)
    plan = sp.plan_shared_prefixes(tables, seq_lens, np.ones(7, dtype=bool), 4, members_per_item=2, min_tokens=8)
    assert plan is not None and sorted(c for *_, c in plan.items.tolist()) == [1, 2, 2, 2]
    assert sorted(plan.members.tolist()) == list(range(7))
    starts = [a for _, _, a, _ in plan.items.tolist()]
    assert sorted(starts) == [0, 2, 4, 5]
    kept = sp.plan_shared_prefixes(tables, seq_lens, np.ones(7, dtype=bool), 4, members_per_item=2, min_tokens=8,
                                   max_items=3)
    assert kept is not None and kept.num_items == 3
    assert kept.kv_start.tolist() == [12] * 5 + [0, 0]   # the group of five: its three items fit, the pair's not


def test_plan_finds_nothing_when_nothing_worth_it_is_shared() -> None:
    decode = np.ones(3, dtype=bool)
    assert sp.plan_shared_prefixes(_tables([[1, 2], [3, 4], [5, 6]]), np.array([8, 8, 8]), decode, 4, 8, 4) is None
    shared_one_block = _tables([[1, 2, 3], [1, 4, 5], [6, 7]])
    assert sp.plan_shared_prefixes(shared_one_block, np.array([12, 12, 8]), decode, 4, 8, min_tokens=8) is None
    assert sp.plan_shared_prefixes(shared_one_block, np.array([12, 12, 8]), decode, 4, 8, min_tokens=4) is not None
    assert sp.plan_shared_prefixes(_tables([[1, 2, 3]]), np.array([12]), decode[:1], 4, 8, 4) is None


def _shared_step(gen: torch.Generator, seqs: list[tuple[int | None, int, int]], prefix_blocks: dict[int, int],
                 block_size: int = 8, hq: int = 8, hkv: int = 2, d: int = 16
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """seqs: (group or None, seq_len, new tokens); a group's sequences begin with the same physical blocks."""
    nxt = 1
    prefixes: dict[int, list[int]] = {}
    for g, n in prefix_blocks.items():
        prefixes[g] = list(range(nxt, nxt + n))
        nxt += n
    tables, seq_lens, q_lens = [], [], []
    for g, seq_len, q_len in seqs:
        table = list(prefixes[g]) if g is not None else []
        while len(table) * block_size < seq_len:
            table.append(nxt)
            nxt += 1
        tables.append(table)
        seq_lens.append(seq_len)
        q_lens.append(q_len)
    perm = torch.randperm(nxt + 2, generator=gen)
    tables = [[int(perm[b]) for b in t] for t in tables]   # shuffled physical blocks, shared ones still shared
    md = build_attention_metadata(q_lens, seq_lens, tables, block_size)
    t = sum(q_lens)
    cache = torch.randn(2, nxt + 2, block_size, hkv, d, generator=gen)
    return (torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen),
            torch.randn(t, hkv, d, generator=gen), cache, md)


STEPS = {
    "decode": ([(0, 40, 1), (1, 30, 1), (0, 33, 1), (None, 21, 1), (0, 57, 1), (1, 25, 1)], {0: 4, 1: 3}),
    "whole context shared": ([(0, 33, 1), (0, 33, 1), (0, 40, 1)], {0: 4}),
    "mixed": ([(0, 40, 1), (None, 20, 20), (0, 35, 1), (1, 44, 12), (1, 50, 1), (1, 26, 1)], {0: 4, 1: 3}),
}


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("kernel_choice", ["v1", "v2"])
def test_triton_op_with_the_shared_prefix_pass_matches_the_reference(name: str, kernel_choice: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel_choice)
    monkeypatch.setattr(sp, "MIN_TOKENS", 8)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqs, prefixes = STEPS[name]
    q, k, v, cache, md = _shared_step(gen, seqs, prefixes)
    cache_ref = cache.clone()
    out = triton_paged_attention(q.clone(), k, v, cache, md, 0.3)
    ref = torch_paged_attention(q, k, v, cache_ref, md, 0.3)
    plan = md.plans[sp.PLAN_KEY]
    assert isinstance(plan, sp.SharedPrefixTensors)            # the pass ran
    assert int((plan.kv_start > 0).sum()) >= 2
    assert rel_err(out, ref) < 1e-5


def test_the_pass_is_off_with_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "ENABLED", False)
    monkeypatch.setattr(sp, "MIN_TOKENS", 8)
    gen = torch.Generator().manual_seed(1)
    q, k, v, cache, md = _shared_step(gen, *STEPS["decode"])
    out = triton_paged_attention(q.clone(), k, v, cache.clone(), md, 0.3)
    assert md.plans[sp.PLAN_KEY] is None
    assert rel_err(out, torch_paged_attention(q, k, v, cache, md, 0.3)) < 1e-5


@pytest.mark.parametrize("splits,direct_single", [(1, False), (3, False), (2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_folds_in_the_prefix_from_static_buffers(splits: int, direct_single: bool,
                                                               dtype: torch.dtype) -> None:
    """As a captured step replays it: the plan written into `SharedPrefixBuffers`, a bucket wider than the
    batch (idle items, rows without a prefix), the split-K merge folding the prefix in (with `direct_single`
    and splits of 24 keys: the sequences left with one split fold it in themselves, the others in the merge)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seqs, prefixes = STEPS["decode"]
    q, k, v, cache, md = _shared_step(gen, seqs, prefixes)
    q, cache = q.to(dtype), cache.to(dtype)
    n, hq, d = q.shape
    hkv = cache.shape[3]
    plan = sp.plan_shared_prefixes(md.block_tables_cpu, np.asarray(md.seq_lens_cpu), np.ones(n, dtype=bool),
                                   cache.shape[2], kernel.members_per_item(hq, hkv), min_tokens=8)
    assert plan is not None
    buffers = sp.SharedPrefixBuffers(16, hq, d, torch.device("cpu"))
    buffers.load(plan, 8)
    t = buffers.tensors(8)
    assert t.items.shape[0] == 4 and int((t.items[:, 3] > 0).sum()) == plan.num_items
    assert t.kv_start[:n].tolist() == plan.kv_start.tolist() and t.kv_start[n:].tolist() == [0] * (8 - n)
    kernel.shared_prefix_attention(q, cache, md.block_tables, md.query_start_loc, t.items, t.members, t.part_out,
                                   t.part_lse, 0.3)
    out = torch.zeros_like(q)
    paged_decode_attention(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3, out,
                           num_splits=splits, merge="kernel", split_tokens=24 if direct_single else None,
                           shared=SharedPrefixArgs(t.kv_start[:n], t.part_out[:n], t.part_lse[:n]),
                           direct_single=direct_single)
    ref = paged_attention_ref(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3)
    assert rel_err(out.float(), ref.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_shared_prefix_arguments_are_checked() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, cache, md = _shared_step(gen, *STEPS["decode"])
    n, hq, d = q.shape
    items = torch.zeros((2, 3), dtype=torch.int32)
    with pytest.raises(ValueError, match="items"):
        kernel.shared_prefix_attention(q, cache, md.block_tables, md.query_start_loc, items,
                                       torch.zeros(4, dtype=torch.int32), torch.zeros(n, hq, d),
                                       torch.zeros(n, hq), 0.3)
    short = SharedPrefixArgs(torch.zeros(2, dtype=torch.int32), torch.zeros(2, hq, d), torch.zeros(2, hq))
    with pytest.raises(ValueError, match="shared"):
        paged_decode_attention(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3, torch.zeros_like(q),
                               shared=short)
    full = SharedPrefixArgs(torch.zeros(n, dtype=torch.int32), torch.zeros(n, hq, d), torch.zeros(n, hq))
    with pytest.raises(ValueError, match="merge"):
        paged_decode_attention(q, cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.3, torch.zeros_like(q),
                               num_splits=2, merge="fused", shared=full)


def test_item_layout_agrees_between_the_planner_and_the_kernel() -> None:
    assert sp.ITEM_FIELDS == kernel.ITEM_FIELDS
    assert kernel.members_per_item(32, 8) == 16 and kernel.members_per_item(16, 16) == 64


def test_plan_splits_prompts_that_only_begin_alike() -> None:
    """Two system prompts with the same first 2 blocks, then 6 blocks of their own: two groups of 6 blocks, not one
    of 2; three rows sharing 2 blocks and nothing more stay one group."""
    a = [1, 2, 10, 11, 12, 13, 14, 15]
    b = [1, 2, 20, 21, 22, 23, 24, 25]
    rows = [a + [100 + i] for i in range(3)] + [b + [200 + i] for i in range(3)]
    plan = sp.plan_shared_prefixes(_tables(rows), np.full(6, 34), np.ones(6, dtype=bool), 4, members_per_item=8,
                                   min_tokens=8)
    assert plan is not None and plan.kv_start.tolist() == [32] * 6 and plan.num_items == 2
    loose = [[1, 2, 30 + i, 40 + i] for i in range(3)]
    plan = sp.plan_shared_prefixes(_tables(loose), np.full(3, 16), np.ones(3, dtype=bool), 4, 8, min_tokens=8)
    assert plan is not None and plan.kv_start.tolist() == [8] * 3 and plan.num_items == 1
