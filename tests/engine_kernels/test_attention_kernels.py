"""Paged decode / prefill attention and the KV write against their PyTorch references."""

from typing import Callable

import pytest
import torch

from kvfleet.engine.kernels import (
    _common,
    choose_num_splits,
    paged_attention_ref,
    paged_decode,
    paged_decode_attention,
    prefill_attention,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from kvfleet.engine.kernels.paged_decode import (
    DecodeSplit,
    choose_decode_split,
    choose_mixed_decode_splits,
    mixed_split_batches,
)
from kvfleet.engine.kernels.prefill_attention import prefill_work
from kvfleet.engine.kernels.rotary_cache import rotary_and_cache, rotary_and_cache_ref

from .paged import TOL, make_batch, rel_err


def test_interpreter_is_active() -> None:
    # Guard: if the kernels were imported before TRITON_INTERPRET was set, nothing here runs on CPU.
    assert _common.interpret_mode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch = make_batch(gen, [5, 17, 3], [5, 2, 1], hq=4, hkv=2, d=16, block_size=4, dtype=dtype)
    batch.slot_mapping[1] = -1  # a skipped (padding) token
    got = batch.kv_cache.clone()
    ref = batch.kv_cache.clone()
    reshape_and_cache(batch.k, batch.v, got, batch.slot_mapping)
    reshape_and_cache_ref(batch.k, batch.v, ref, batch.slot_mapping)
    assert torch.equal(got, ref)
    assert not torch.equal(got, batch.kv_cache)


def test_reshape_and_cache_rejects_bad_shapes() -> None:
    cache = torch.zeros(2, 4, 4, 2, 8)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="^k:"):
        reshape_and_cache(torch.zeros(3, 3, 8), k, cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype,hq,hkv,splits", [
    (torch.float32, 4, 2, 1),
    (torch.float32, 8, 2, 3),
    (torch.bfloat16, 4, 1, 4),
    (torch.float16, 2, 2, 2),
])
def test_paged_decode_matches_reference(dtype: torch.dtype, hq: int, hkv: int, splits: int) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq_lens = torch.randint(1, 150, (4,), generator=gen).tolist()
    batch = make_batch(gen, seq_lens, [1] * 4, hq=hq, hkv=hkv, d=32, block_size=16, dtype=dtype)
    scale = 32 ** -0.5
    out = torch.full_like(batch.q, float("nan"))  # poison: every row must be written
    paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                           batch.query_start_loc, scale, out, num_splits=splits, block_n=32)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("merge,split_tokens,splits", [
    ("fused", 16, 5), ("kernel", 16, 5), ("fused", 96, 8), ("kernel", 96, 8), ("fused", 4096, 3),
])
def test_paged_decode_merges_and_split_sizes(merge: str, split_tokens: int, splits: int) -> None:
    # a padding row (context 0, as in a CUDA-graph batch), short and long contexts; the fused merge
    # twice in a row: its counters must be back at 0 after each call
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq_lens = [0, 1, 33, 140, 200]
    batch = make_batch(gen, [max(1, s) for s in seq_lens], [1] * 5, hq=8, hkv=2, d=32, block_size=16,
                       dtype=torch.float32)
    batch.seq_lens[0] = 0
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 0.2)
    for _ in range(2):
        out = torch.full_like(batch.q, float("nan"))
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                               0.2, out, num_splits=splits, block_n=32, merge=merge, split_tokens=split_tokens)
        assert torch.equal(out[0], torch.zeros_like(out[0]))   # no keys: zeros, as the reference
        assert rel_err(out[1:], ref[1:]) < 1e-5
        if merge == "fused":
            assert all(int(c.abs().sum()) == 0 for c in paged_decode._COUNTERS[out.device])


def test_choose_num_splits() -> None:
    # split only when the batch leaves SMs idle, never more than the keys allow
    assert choose_num_splits(82, 8, 8448) == 1
    assert choose_num_splits(1, 8, 1024) == 16
    assert choose_num_splits(16, 8, 4096) == 3
    assert choose_num_splits(1, 8, 100) == 2
    # KVFLEET_DECODE_MIN_SPLITS's floor, within what the length allows
    assert choose_num_splits(82, 8, 8448, min_splits=2) == 2
    assert choose_num_splits(461, 8, 4096, min_splits=3) == 3
    assert choose_num_splits(461, 8, 64, min_splits=2) == 1
    assert choose_num_splits(1, 8, 1024, min_splits=2) == 16
    # KVFLEET_DECODE_PROGRAMS_PER_SM: how many programs an SM the split count aims at (lease 25's 12 x 6k)
    assert choose_num_splits(12, 8, 8448) == 3
    assert choose_num_splits(12, 8, 8448, programs_per_sm=4) == 6
    assert choose_num_splits(48, 8, 8448, programs_per_sm=4) == 2
    assert choose_num_splits(48, 8, 8448, programs_per_sm=1) == 1


def test_mixed_decode_splits_follow_the_decode_rows_in_powers_of_two() -> None:
    # lease 25's long-prompt steps: 1-11 decodes of ~6k keys beside a chunk ran unsplit (8-88 programs, 132 SMs)
    assert [choose_mixed_decode_splits(n, 8, 6200) for n in (1, 2, 3, 5, 10, 12, 33, 400)] == [16, 16, 8, 4, 4, 2, 1, 1]
    assert choose_mixed_decode_splits(0, 8, 6200) == 1
    assert choose_mixed_decode_splits(1, 8, 150) == 2              # no more splits than the keys allow (3, rounded)
    assert choose_mixed_decode_splits(1, 8, 6200, max_splits=1) == 1   # KVFLEET_MIXED_DECODE_SPLITS=1: off
    assert choose_mixed_decode_splits(1, 8, 6200, max_splits=4) == 4
    # the step's other rows take a program a split too: the grid stays within 32 programs an SM
    assert choose_mixed_decode_splits(1, 8, 6200, batch=13) == 16       # lease 25's long prompts: 1,664 programs
    assert choose_mixed_decode_splits(1, 8, 6200, batch=100) == 4       # at most 5 splits for 800 rows x heads
    assert choose_mixed_decode_splits(1, 8, 6200, batch=4000) == 1      # thousands of short prompts beside it
    # what the warm-up sends: the fewest decode rows for each count, no more rows than given
    assert mixed_split_batches(8, 1000, 132, 255, max_splits=16) == {16: 1, 8: 3, 4: 5, 2: 11}
    assert mixed_split_batches(8, 1000, 132, 4, max_splits=16) == {16: 1, 8: 3}
    assert mixed_split_batches(8, 1000, 132, 255, max_splits=1) == {}
    # every count a mixed step can launch at contexts up to 1,000 keys is among them
    launched = {choose_mixed_decode_splits(n, 8, length, 132, 16) for n in range(1, 300) for length in range(2, 1001)}
    assert launched - {1} == set(mixed_split_batches(8, 1000, 132, 299, max_splits=16))


def test_choose_decode_split_splits_long_contexts_only() -> None:
    # off: the batch-filling rule alone
    assert choose_decode_split(82, 8, 8448, long_split=0) == DecodeSplit(1, 64, False)
    assert choose_decode_split(1, 8, 1024, long_split=0) == DecodeSplit(16, 64, False)
    # on: two splits of at least L keys where the batch alone gives one (each sequence of the launch is split
    # only if its keys exceed L: the kernel's rule)
    assert choose_decode_split(82, 8, 8448, long_split=2048) == DecodeSplit(2, 2048, True)
    assert choose_decode_split(461, 8, 4096, long_split=2048) == DecodeSplit(2, 2048, True)
    assert choose_decode_split(461, 8, 2048, long_split=2048) == DecodeSplit(1, 64, False)
    assert choose_decode_split(1, 8, 8192, long_split=2048) == DecodeSplit(32, 64, False)   # the batch rule wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_single_writes_short_sequences_and_merges_long_ones(dtype: torch.dtype) -> None:
    """Two splits of at least 64 keys: the short sequences (and a padding row) are written by split 0 alone, the
    long ones through the partials and the merge kernel; every row as the reference (NaN-poisoned output)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq_lens = [0, 5, 64, 65, 150, 200]
    batch = make_batch(gen, [max(1, s) for s in seq_lens], [1] * 6, hq=8, hkv=2, d=32, block_size=16, dtype=dtype)
    batch.seq_lens[0] = 0
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 0.2)
    split = DecodeSplit(2, 64, True)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.2,
                           out, num_splits=split.num_splits, block_n=32, split_tokens=split.split_tokens,
                           direct_single=split.direct_single)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], ref[1:]) < TOL[dtype]
    # the short ones exactly as a one-split launch computes them
    one = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.2,
                           one, num_splits=1, block_n=32)
    assert torch.equal(out[:3], one[:3])
    with pytest.raises(ValueError, match="direct_single"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                               0.2, out, num_splits=2, merge="fused", direct_single=True)


def test_long_split_knob_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("x", "-1"):
        monkeypatch.setenv("KVFLEET_DECODE_LONG_SPLIT", bad)
        with pytest.raises(ValueError, match="KVFLEET_DECODE_LONG_SPLIT"):
            paged_decode._long_split_from_env()
    monkeypatch.setenv("KVFLEET_DECODE_LONG_SPLIT", "4096")
    assert paged_decode._long_split_from_env() == 4096


def test_merge_counters_grow_without_freeing_the_smaller() -> None:
    # a CUDA graph captured at a small batch keeps using the buffer it captured
    small = paged_decode._merge_counters(torch.device("cpu"), 8)
    big = paged_decode._merge_counters(torch.device("cpu"), small.numel() + 1)
    assert big.numel() > small.numel() and not big.any()
    assert any(c is small for c in paged_decode._COUNTERS[torch.device("cpu")])
    assert paged_decode._merge_counters(torch.device("cpu"), 8) is big


def test_paged_decode_rejects_unknown_merge() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [10], [1], hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="merge"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, 1.0, torch.empty_like(batch.q), num_splits=2, merge="x")


@pytest.mark.parametrize("dtype,half_table,rotate_k,norm", [
    (torch.float32, False, False, False), (torch.bfloat16, False, False, False), (torch.float16, True, False, False),
    (torch.bfloat16, False, True, False), (torch.float32, True, True, False),
    (torch.float32, False, False, True), (torch.bfloat16, False, True, True), (torch.float16, True, True, True),
])
def test_rotary_and_cache_matches_reference(dtype: torch.dtype, half_table: bool, rotate_k: bool,
                                            norm: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch = make_batch(gen, [5, 17, 3], [5, 2, 1], hq=6, hkv=2, d=16, block_size=4, dtype=dtype)
    batch.slot_mapping[1] = -1  # a skipped (padding) token
    t = batch.q.shape[0]
    freqs = torch.rand(t, 8, generator=gen) * 10
    emb = freqs if half_table else torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qw = kw = None
    if norm:   # per-head RMSNorm first (Qwen3), weights far from 1 so a missing or swapped weight shows
        qw, kw = (torch.rand(16, generator=gen) * 2 + 0.25).to(dtype), (torch.rand(16, generator=gen) * 2).to(dtype)
    q, k = batch.q.clone(), batch.k.clone()
    got_cache, ref_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    rotary_and_cache(q, k, batch.v, cos, sin, got_cache, batch.slot_mapping, rotate_k=rotate_k,
                     q_norm_weight=qw, k_norm_weight=kw, norm_eps=1e-5)
    ref_q = rotary_and_cache_ref(batch.q, batch.k, batch.v, cos, sin, ref_cache, batch.slot_mapping,
                                 q_norm_weight=qw, k_norm_weight=kw, norm_eps=1e-5)
    if rotate_k:   # rotated in place, every row (the padding one too), exactly as the cache got it
        ref_k = rotary_and_cache_ref(batch.k, batch.k, batch.v, cos, sin, ref_cache.clone(), batch.slot_mapping,
                                     q_norm_weight=kw, k_norm_weight=kw, norm_eps=1e-5)
        assert rel_err(k, ref_k) < TOL[dtype]
        written = batch.slot_mapping >= 0
        assert torch.equal(got_cache[0].flatten(0, 1)[batch.slot_mapping[written]], k[written])
    else:
        assert torch.equal(k, batch.k)   # k is only written to the cache
    assert rel_err(q, ref_q) < TOL[dtype]
    assert torch.equal(got_cache[1], ref_cache[1])   # v copied; slot -1 and every other slot untouched
    flat_got, flat_ref = got_cache[0].flatten(0, 1), ref_cache[0].flatten(0, 1)
    written = batch.slot_mapping[batch.slot_mapping >= 0]
    assert rel_err(flat_got[written], flat_ref[written]) < TOL[dtype]
    others = torch.ones(flat_got.shape[0], dtype=torch.bool)
    others[written] = False
    assert torch.equal(flat_got[others], batch.kv_cache[0].flatten(0, 1)[others])


def test_rotary_and_cache_normalises_strided_heads_of_one_qkv_buffer() -> None:
    """As the model calls it: q, k, v are column slices of the qkv projection's output. q and k are normalised and
    rotated in place (k with rotate_k), v and the padding between nothing else is touched."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    t, hq, hk, d = 7, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen, dtype=torch.bfloat16)
    before = qkv.clone()
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    freqs = torch.rand(t, d // 2, generator=gen) * 10
    cos, sin = freqs.cos(), freqs.sin()
    qw, kw = torch.rand(d, generator=gen).to(torch.bfloat16) + 0.5, torch.rand(d, generator=gen).to(torch.bfloat16)
    cache, ref_cache = torch.zeros(2, 4, 4, hk, d, dtype=torch.bfloat16), torch.zeros(2, 4, 4, hk, d,
                                                                                       dtype=torch.bfloat16)
    slots = torch.tensor([3, 0, 9, -1, 4, 12, 7])
    b_q, b_k, b_v = (x.reshape(t, -1, d) for x in before.split([hq * d, hk * d, hk * d], dim=-1))
    ref_q = rotary_and_cache_ref(b_q, b_k, b_v, cos, sin, ref_cache, slots, q_norm_weight=qw, k_norm_weight=kw)
    ref_k = rotary_and_cache_ref(b_k, b_k, b_v, cos, sin, ref_cache.clone(), slots, q_norm_weight=kw,
                                 k_norm_weight=kw)
    rotary_and_cache(q, k, v, cos, sin, cache, slots, rotate_k=True, q_norm_weight=qw, k_norm_weight=kw)
    assert rel_err(q, ref_q) < TOL[torch.bfloat16] and rel_err(k, ref_k) < TOL[torch.bfloat16]
    assert torch.equal(v, b_v)
    assert rel_err(cache, ref_cache) < TOL[torch.bfloat16]


def test_rotary_and_cache_rejects_bad_norm_weights() -> None:
    cache = torch.zeros(2, 4, 4, 2, 8)
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    cs, slots = torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="^k_norm_weight: missing"):
        rotary_and_cache(q, k, k, cs, cs, cache, slots, q_norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="^q_norm_weight: size 4 != head_dim 8"):
        rotary_and_cache(q, k, k, cs, cs, cache, slots, q_norm_weight=torch.ones(4), k_norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="^norm_eps"):
        rotary_and_cache(q, k, k, cs, cs, cache, slots, q_norm_weight=torch.ones(8), k_norm_weight=torch.ones(8),
                         norm_eps=0.0)


def test_rotary_and_cache_rejects_bad_shapes() -> None:
    cache = torch.zeros(2, 4, 4, 2, 8)
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    cs = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_and_cache(q, k, k, cs, cs, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="^kv_cache:"):
        rotary_and_cache(q, k, k, cs, cs, torch.zeros(2, 4, 4, 3, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="^cos:"):
        rotary_and_cache(q, k, k, cs[:2], cs, cache, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("dtype,block_m,use_work", [(torch.float32, 16, False), (torch.bfloat16, 16, True),
                                                    (torch.float32, 32, True)])
def test_prefill_with_cached_prefix_matches_reference(dtype: torch.dtype, block_m: int, use_work: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # fresh prompt, chunk after a cached prefix, a single-token decode, a longer chunk
    q_lens = [19, 7, 1, 40]
    prefix = [0, 30, 25, 9]
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    batch = make_batch(gen, seq_lens, q_lens, hq=4, hkv=2, d=16, block_size=8, dtype=dtype)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    scale = 0.3
    out = torch.full_like(batch.q, float("nan"))
    work = prefill_work(batch.query_start_loc.tolist(), block_m, False, "cpu") if use_work else None
    prefill_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                      batch.max_query_len, scale, out, block_m=block_m, block_n=16, work=work)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, scale)
    assert rel_err(out, ref) < TOL[dtype]


def test_mixed_batch_split_between_kernels() -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q_lens, seq_lens = [1, 12, 1], [40, 20, 70]
    batch = make_batch(gen, seq_lens, q_lens, hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32)
    out = torch.full_like(batch.q, float("nan"))
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    prefill_attention(*args, batch.max_query_len, 0.25, out, skip_decode=True)
    assert torch.isnan(out[0]).all() and torch.isnan(out[13]).all()  # decode rows left alone
    paged_decode_attention(*args, 0.25, out, num_splits=2, block_n=16)
    ref = paged_attention_ref(*args, 0.25)
    assert rel_err(out, ref) < 1e-5


def test_prefill_work_list_skips_decode_rows() -> None:
    work = prefill_work([0, 1, 40, 41, 41, 58], 16, True, "cpu")
    assert work.tolist() == [[1, 0], [1, 1], [1, 2], [4, 0], [4, 1]]
    assert prefill_work([0, 1, 2], 16, True, "cpu").shape == (0, 2)


def test_attention_rejects_bad_metadata() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [10], [1], hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_attention(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc[:1], 1.0, out)
    with pytest.raises(ValueError, match="block_tables"):
        prefill_attention(batch.q, batch.kv_cache, batch.block_tables.long(), batch.seq_lens,
                          batch.query_start_loc, 1, 1.0, out)
    with pytest.raises(ValueError, match="^q:"):
        prefill_attention(batch.q[:, :3], batch.kv_cache, batch.block_tables, batch.seq_lens,
                          batch.query_start_loc, 1, 1.0, torch.empty_like(batch.q[:, :3]))


@pytest.mark.parametrize("name, read, bad, good, default", [
    ("KVFLEET_DECODE_MIN_SPLITS", paged_decode._min_splits_from_env, ("0", "33", "two"), 2, 1),
    ("KVFLEET_DECODE_PROGRAMS_PER_SM", paged_decode._programs_per_sm_from_env, ("0", "17", "many"), 4, 2),
    ("KVFLEET_MIXED_DECODE_SPLITS", paged_decode._mixed_max_splits_from_env, ("0", "3", "64", "all"), 1, 16),
])
def test_split_knobs_reject_bad_values(monkeypatch: pytest.MonkeyPatch, name: str, read: Callable[[], int],
                                       bad: tuple[str, ...], good: int, default: int) -> None:
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            read()
    monkeypatch.setenv(name, str(good))
    assert read() == good
    monkeypatch.delenv(name)
    assert read() == default
