"""Paged attention for decode steps (one query token per sequence), flash-decoding style.

One program handles every query head of one KV head (GQA: the ``G = Hq / Hkv``
query heads share each K/V tile they load, padded to 16 rows for ``tl.dot``) for
one sequence and one split of its context. Long contexts with few sequences are
split along the keys (split-K); the partial results are merged with their
log-sum-exp, either by a second small kernel or (``merge="fused"``) by the last
split program of each (sequence, KV head) to finish, found with an atomic counter:
one launch instead of two. The number of split programs depends only on the batch
shape, so the launch is the same for every replay of a CUDA graph; how many of them
get keys depends on each sequence's length (splits of at least ``split_tokens``
keys), so a graph captured for the longest context still reads a short one in a
few splits.

Sequences whose query length in this step is not 1 are skipped (the prefill
kernel handles them), so one mixed batch can be served by both kernels.

With ``shared`` (`SharedPrefixArgs`, cascade attention), a sequence whose leading blocks are shared with
other decoding sequences reads its keys from ``kv_start[b]`` on: `kernels.shared_prefix` has already
attended its query over the shared prefix, once for the whole group, and left a normalized partial and its
log-sum-exp, which the last step (the single split's program, or the merge kernel) folds in.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    check_paged_attention_args,
    check_tensor,
    dot_precision,
    fail,
    int_from_env,
    next_pow2,
    upcast_dots,
)

LOG2E = 1.4426950408889634


def _tile_from_env() -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): KVFLEET_DECODE_TILE="64,4,3" overrides the default, which
    was the fastest of the H200 sweep in bench/NOTES.md (bench/gpu_run.sh sets it from its own sweep)."""
    raw = os.environ.get("KVFLEET_DECODE_TILE", "").strip()
    if not raw:
        return 64, 4, 3
    try:
        bn, warps, stages = (int(x) for x in raw.split(","))
    except ValueError as e:
        raise ValueError(f"KVFLEET_DECODE_TILE: expected 'BLOCK_N,num_warps,num_stages', got {raw!r}") from e
    if not (bn in (16, 32, 64, 128, 256) and warps in (1, 2, 4, 8, 16) and 1 <= stages <= 6):
        fail("KVFLEET_DECODE_TILE", f"unsupported tile {raw!r}")
    return bn, warps, stages


DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES = _tile_from_env()

MERGES = ("fused", "kernel")


def _merge_from_env() -> str:
    """KVFLEET_DECODE_MERGE: "kernel" (default: a second launch merges the splits) or "fused" (the last split
    program merges). On the H200 (issue 16, lease 3) the fused merge was slower: 10.98 against 7.84 us a layer
    at batch 1, and the engine's graph step 5.04 against 4.89 ms (bench/results/issue16/lease3/decode_step.txt)."""
    raw = os.environ.get("KVFLEET_DECODE_MERGE", "").strip() or "kernel"
    if raw not in MERGES:
        fail("KVFLEET_DECODE_MERGE", f"expected one of {MERGES}, got {raw!r}")
    return raw


def _split_tokens_from_env() -> int:
    """KVFLEET_DECODE_SPLIT_TOKENS: the fewest keys a split gets (default 64: one tile)."""
    return int_from_env("KVFLEET_DECODE_SPLIT_TOKENS", 64, 16, 65536)


def _min_splits_from_env() -> int:
    """KVFLEET_DECODE_MIN_SPLITS: the fewest splits of each sequence's keys where its length allows (default 1: split
    only when batch x KV heads leaves the GPU underused). On the H200 2 was faster than 1 at every decode shape of
    the offline workloads in one layer (issue 16, lease 7: 4-18 %), but end to end (lease 8) it took 1.4 ms off
    each decode step at 6.3k keys and added 0.7 ms at 1.1k: the default stays 1
    (KVFLEET_DECODE_LONG_SPLIT splits by length instead)."""
    return int_from_env("KVFLEET_DECODE_MIN_SPLITS", 1, 1, 32)


def _programs_per_sm_from_env() -> int:
    """KVFLEET_DECODE_PROGRAMS_PER_SM: the split count aims at this many programs an SM (default 2) where batch x
    KV heads alone gives fewer. Lease 25's long-prompts profile (12 sequences of ~6k keys, 3 splits: 288 programs
    for 132 SMs, each reading 2k keys one tile at a time) put our decode kernel at 145 ms against FlashAttention-3's
    95 over the same steps, while at 48 x 6k (one split, 384 programs) the two are level: more programs an SM may
    keep more copies in flight."""
    return int_from_env("KVFLEET_DECODE_PROGRAMS_PER_SM", 2, 1, 16)


def _mixed_max_splits_from_env() -> int:
    """KVFLEET_MIXED_DECODE_SPLITS: the most splits the decode rows of an eager mixed step get (default 16; 1: none,
    as before; a power of two). Those rows used to run unsplit, one program per sequence and KV head reading the
    whole context: lease 25's long-prompt steps had 1-11 decodes of ~6k keys beside each 8k-token chunk, at most
    88 programs for 132 SMs (`choose_mixed_decode_splits`)."""
    n = int_from_env("KVFLEET_MIXED_DECODE_SPLITS", 16, 1, 32)
    if n & (n - 1):
        fail("KVFLEET_MIXED_DECODE_SPLITS", f"expected a power of two in [1, 32], got {n}")
    return n


def _long_split_from_env() -> int:
    """KVFLEET_DECODE_LONG_SPLIT: contexts of more than this many keys are read in two splits where the batch alone
    would not split them (`choose_decode_split`; default 0: off. Issue 16's lease 9 at 2048: 1.1 ms off each
    long-prompt decode step, 0.8 ms onto each random-1024-128 one under CUDA graphs, whose launches always split;
    throughput +0.9 / -0.2 %). The decode graphs now have one-split variants for contexts of up to this many keys
    (`cuda_graphs.short_context_sizes`), so short contexts no longer pay for it under graphs."""
    return int_from_env("KVFLEET_DECODE_LONG_SPLIT", 0, 0, 1 << 20)


class SharedPrefixArgs(NamedTuple):
    """What the decode kernel needs of a step's shared-prefix pass (`kernels.shared_prefix`)."""

    kv_start: torch.Tensor    # int32 [B]: each sequence's first key left to read (its shared prefix; 0 = none)
    part_out: torch.Tensor    # float32 [B, Hq, D]: the prefix's normalized partial output (where kv_start > 0)
    part_lse: torch.Tensor    # float32 [B, Hq]: its log2-sum-exp


DEFAULT_MERGE = _merge_from_env()
DEFAULT_SPLIT_TOKENS = _split_tokens_from_env()
DEFAULT_MIN_SPLITS = _min_splits_from_env()
DEFAULT_LONG_SPLIT = _long_split_from_env()
DEFAULT_PROGRAMS_PER_SM = _programs_per_sm_from_env()
MIXED_MAX_SPLITS = _mixed_max_splits_from_env()

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), kept between calls: the merging program
    sets its counter back to 0, so one allocation serves every layer, step and graph replay. A larger
    batch gets a larger buffer; the smaller ones are kept alive, as captured CUDA graphs still use them."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def attend_paged_tile(q, m_i, l_i, acc, k_base, bt_row, n0, end, d, dmask, scale_log2,
                      stride_c_kv, stride_c_blk, stride_c_slot,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step of queries `q` [rows, D] over keys n0..n0+BLOCK_N (those < `end`) of one KV head,
    read through the block-table row `bt_row`: the updated running max, sum and unnormalized output (log2 domain;
    `scale_log2` folds the softmax scale and log2(e)). Shared by the decode and shared-prefix kernels."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    row = blk * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_slot
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(k_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _key_splits(keys, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """(key tiles per split, splits that get keys) for a sequence's `keys` keys: at least MIN_TILES tiles a split,
    so a short sequence leaves the later split programs without keys (the decode and merge kernels' one rule)."""
    tiles = tl.cdiv(keys, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), MIN_TILES)
    return tiles_per_split, tl.cdiv(tiles, tiles_per_split)


# The block-table width changes from step to step: specializing on it (== 1, multiple of 16) would compile
# new variants on live requests' time (issue 16's TTFT p99); nothing in the kernel gains from it.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, kv_start_ptr, pre_out_ptr, pre_lse_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    stride_pb, stride_ph, stride_ps,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr,
    FUSED_MERGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, S_PAD: tl.constexpr, SHARED: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, DIRECT_SINGLE: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    kv0 = 0
    if SHARED:
        kv0 = tl.load(kv_start_ptr + b)   # the keys before it were read once for the sequences sharing them
    tiles_per_split, used = _key_splits(seq_len - kv0, BLOCK_N, NUM_SPLITS, MIN_TILES)
    start = kv0 + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    # DIRECT_SINGLE: a sequence whose keys all fall to split 0 is finished there, as with one split (no partials,
    # no merge); its other split programs have nothing to do
    single = used <= 1
    if DIRECT_SINGLE:
        if single & (split > 0):
            return

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    gmask = g < G
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_c_head
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = attend_paged_tile(q, m_i, l_i, acc, k_base, bt_row, n0, end, d, dmask, scale_log2,
                                          stride_c_kv, stride_c_blk, stride_c_slot,
                                          BLOCK_SIZE, BLOCK_N, UPCAST, PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        _store_whole(out, l_i, l_safe, m_i, out_ptr, pre_out_ptr, pre_lse_ptr, q_start, b, heads, d, gmask, dmask,
                     kv0, stride_ot, stride_oh, G, HEAD_DIM, NUM_KV_HEADS, SHARED)
    elif DIRECT_SINGLE:
        if single:
            _store_whole(out, l_i, l_safe, m_i, out_ptr, pre_out_ptr, pre_lse_ptr, q_start, b, heads, d, gmask,
                         dmask, kv0, stride_ot, stride_oh, G, HEAD_DIM, NUM_KV_HEADS, SHARED)
        else:
            _store_partial(out, l_i, l_safe, m_i, part_out_ptr, part_lse_ptr, b, heads, split, d, gmask, omask,
                           stride_pb, stride_ph, stride_ps, HEAD_DIM)
    else:
        _store_partial(out, l_i, l_safe, m_i, part_out_ptr, part_lse_ptr, b, heads, split, d, gmask, omask,
                       stride_pb, stride_ph, stride_ps, HEAD_DIM)
        if FUSED_MERGE:
            # every thread's partial stores, then one gpu-scope acq_rel increment: the program that sees
            # NUM_SPLITS - 1 is the last, and the others' partials are visible to it
            tl.debug_barrier()
            counter = counter_ptr + b * NUM_KV_HEADS + kvh
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == NUM_SPLITS - 1:
                # as _merge_kernel, one query head at a time, over the splits that got keys (the rest are empty)
                sp = tl.arange(0, S_PAD)
                smask = sp < used
                for gi in tl.static_range(G):
                    pb = b.to(tl.int64) * stride_pb + (kvh * G + gi) * stride_ph + sp * stride_ps
                    lse_s = tl.load(part_lse_ptr + pb, mask=smask, other=float("-inf"), cache_modifier=".cg")
                    m_s = tl.max(lse_s, 0)
                    m_s = tl.where(m_s == float("-inf"), 0.0, m_s)
                    w = tl.math.exp2(lse_s - m_s)
                    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
                    parts = tl.load(part_out_ptr + pb[:, None] * HEAD_DIM + d[None, :],
                                    mask=smask[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
                    merged = tl.sum(parts * w[:, None], 0)
                    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + (kvh * G + gi) * stride_oh + d,
                             merged.to(out_ptr.dtype.element_ty), mask=dmask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")   # ready for the next layer or replay


@triton.jit
def _store_whole(out, l_i, l_safe, m_i, out_ptr, pre_out_ptr, pre_lse_ptr, q_start, b, heads, d, gmask, dmask, kv0,
                 stride_ot, stride_oh, G: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 SHARED: tl.constexpr):
    """A sequence's whole attention (its one split) into the output, the shared prefix's partial folded in."""
    if SHARED:
        # fold in the shared prefix's partial (masked off, i.e. weight 0, where the sequence has none)
        has = gmask & (kv0 > 0)
        pre = b.to(tl.int64) * (NUM_KV_HEADS * G) + heads
        lse_p = tl.load(pre_lse_ptr + pre, mask=has, other=float("-inf"))
        o_p = tl.load(pre_out_ptr + pre[:, None] * HEAD_DIM + d[None, :], mask=has[:, None] & dmask[None, :],
                      other=0.0)
        lse_s = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        top = tl.maximum(lse_s, lse_p)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_s = tl.math.exp2(lse_s - top)
        w_p = tl.math.exp2(lse_p - top)
        out = (out * w_s[:, None] + o_p * w_p[:, None]) / tl.maximum(w_s + w_p, 1e-30)[:, None]
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _store_partial(out, l_i, l_safe, m_i, part_out_ptr, part_lse_ptr, b, heads, split, d, gmask, omask,
                   stride_pb, stride_ph, stride_ps, HEAD_DIM: tl.constexpr):
    """One split's normalized partial and its log2-sum-exp (-inf for an empty split), for the merge."""
    base = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], out, mask=omask)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    tl.store(part_lse_ptr + base, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, kv_start_ptr, pre_out_ptr, pre_lse_ptr,
    stride_ot, stride_oh, stride_pb, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, SHARED: tl.constexpr,
    DIRECT_SINGLE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + b)
    if tl.load(qsl_ptr + b + 1) - q_start != 1:
        return
    if DIRECT_SINGLE:
        # the decode kernel's rule: a sequence with one split of keys was written there
        kv0 = 0
        if SHARED:
            kv0 = tl.load(kv_start_ptr + b)
        _, used = _key_splits(tl.load(seq_lens_ptr + b) - kv0, BLOCK_N, NUM_SPLITS, MIN_TILES)
        if used <= 1:
            return
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    base = b.to(tl.int64) * stride_pb + h * stride_ph + s * stride_ps
    lse = tl.load(part_lse_ptr + base, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    lse_p = float("-inf")
    if SHARED:
        # the shared prefix's partial is one more term (none where the sequence has no shared prefix)
        pre = b.to(tl.int64) * NUM_Q_HEADS + h
        has = tl.load(kv_start_ptr + b) > 0
        lse_p = tl.load(pre_lse_ptr + pre, mask=has, other=float("-inf"))
        m = tl.maximum(m, lse_p)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    w_p = tl.math.exp2(lse_p - m)
    total = tl.maximum(tl.sum(w, 0) + w_p, 1e-30)
    parts = tl.load(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :],
                    mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * w[:, None], 0)
    if SHARED:
        o_p = tl.load(pre_out_ptr + pre * HEAD_DIM + d, mask=has & (d < HEAD_DIM), other=0.0)
        out = out + o_p * w_p
    out = out / total
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      block_n: int = 64, min_tokens_per_split: int | None = None, max_splits: int = 32,
                      min_splits: int | None = None, programs_per_sm: int | None = None) -> int:
    """Split the keys when batch x KV heads alone gives fewer than `programs_per_sm` programs an SM, and at least
    `min_splits` times where the length allows (min_tokens_per_split, min_splits, programs_per_sm:
    KVFLEET_DECODE_SPLIT_TOKENS, KVFLEET_DECODE_MIN_SPLITS and KVFLEET_DECODE_PROGRAMS_PER_SM unless given)."""
    if min_tokens_per_split is None:
        min_tokens_per_split = DEFAULT_SPLIT_TOKENS
    if min_splits is None:
        min_splits = DEFAULT_MIN_SPLITS
    if programs_per_sm is None:
        programs_per_sm = DEFAULT_PROGRAMS_PER_SM
    programs = max(1, batch * num_kv_heads)
    want = max(min_splits, math.ceil(programs_per_sm * num_sms / programs))
    by_len = max(1, math.ceil(max_seq_len / max(min_tokens_per_split, block_n)))
    return int(max(1, min(want, by_len, max_splits)))


MIXED_GRID_PROGRAMS_PER_SM = 32   # a mixed step's decode launch: at most this many programs an SM, exiting ones too


def choose_mixed_decode_splits(num_decodes: int, num_kv_heads: int, max_decode_len: int, num_sms: int = 132,
                               max_splits: int | None = None, batch: int | None = None) -> int:
    """The split count of an eager mixed step's decode rows: `choose_num_splits` for those rows alone (their
    count and longest context, not the step's whole batch), at most ``max_splits`` (KVFLEET_MIXED_DECODE_SPLITS
    unless given), rounded down to a power of two. The rounding bounds the kernel variants (the count is a
    constexpr) to the few the warm-up runs (`mixed_split_batches`), so none is compiled on a request's time.
    The launch's grid has every row of the step (``batch``, the decode rows when not given): the prompts' rows
    exit at once but still take a program each split, so a step of many short prompts beside a few decodes gets
    fewer splits, keeping the grid within `MIXED_GRID_PROGRAMS_PER_SM` programs an SM."""
    if max_splits is None:
        max_splits = MIXED_MAX_SPLITS
    rows = max(num_decodes, batch or 0)
    max_splits = min(max_splits, MIXED_GRID_PROGRAMS_PER_SM * num_sms // max(1, rows * num_kv_heads))
    if num_decodes < 1 or max_splits <= 1:
        return 1
    splits = choose_num_splits(num_decodes, num_kv_heads, max_decode_len, num_sms, max_splits=max_splits)
    return 1 << (splits.bit_length() - 1)


def mixed_split_batches(num_kv_heads: int, context_len: int, num_sms: int, max_decodes: int,
                        max_splits: int | None = None) -> dict[int, int]:
    """Every split count above 1 that mixed steps with contexts of up to ``context_len`` keys can launch, each with
    the fewest decode rows of ``context_len`` keys that give it (at most ``max_decodes``): what the warm-up sends
    (a step's other rows only ever lower the count)."""
    found: dict[int, int] = {}
    for n in range(1, max_decodes + 1):
        splits = choose_mixed_decode_splits(n, num_kv_heads, context_len, num_sms, max_splits)
        if splits == 1:
            break
        found.setdefault(splits, n)
    return found


class DecodeSplit(NamedTuple):
    """How a decode launch splits each sequence's keys (`choose_decode_split`)."""

    num_splits: int
    split_tokens: int        # the fewest keys a split gets (the kernel's MIN_TILES)
    direct_single: bool      # a sequence left with one split is written directly (no partials, no merge)


def choose_decode_split(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                        long_split: int | None = None) -> DecodeSplit:
    """`choose_num_splits`, and with ``long_split`` = L > 0 (KVFLEET_DECODE_LONG_SPLIT unless given): where that
    leaves one split and contexts may exceed L keys, two splits of at least L keys, so a sequence of more than L
    keys is read in two parts (halves from 2L on) while a shorter one stays whole and writes its output directly
    (issue 16, lease 8: two splits took 1.4 ms off a decode step at 82 sequences x 6.3k keys, but a floor of two
    splits for every sequence added 0.7 ms at 461 x 1.1k). Under CUDA graphs
    ``max_seq_len`` is max_model_len: which sequences split is the kernel's choice, from each one's length."""
    if long_split is None:
        long_split = DEFAULT_LONG_SPLIT
    splits = choose_num_splits(batch, num_kv_heads, max_seq_len, num_sms)
    if splits == 1 and long_split > 0 and max_seq_len > long_split:
        return DecodeSplit(2, max(DEFAULT_SPLIT_TOKENS, long_split), True)
    return DecodeSplit(splits, DEFAULT_SPLIT_TOKENS, False)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    split_tokens: int | None = None,
    shared: SharedPrefixArgs | None = None,
    direct_single: bool = False,
) -> torch.Tensor:
    """Attention of the one query token of each decode sequence over its paged context.

    ``q``/``out`` ``[T, Hq, D]``; sequence ``b``'s token is row ``query_start_loc[b]``
    (sequences whose query length is not 1 are left untouched in ``out``). ``merge`` ("fused" or
    "kernel") and ``split_tokens`` (fewest keys per split) default to KVFLEET_DECODE_MERGE and
    KVFLEET_DECODE_SPLIT_TOKENS. ``shared``: the step's shared-prefix pass has run (see the module's doc).
    ``direct_single``: a sequence whose keys all fall to one split is written by that split's program, with no
    partials and no merge (`DecodeSplit`; the merge kernel only).
    """
    block_size, hkv, d, hq, batch = check_paged_attention_args(q, out, kv_cache, block_tables, seq_lens,
                                                                query_start_loc)
    if not (block_tables.shape[0] >= batch):
        fail("block_tables", f"{block_tables.shape[0]} rows < batch {batch}")
    if not (num_splits >= 1):
        fail("num_splits", "must be >= 1")
    merge = merge or DEFAULT_MERGE
    if merge not in MERGES:
        fail("merge", f"expected one of {MERGES}, got {merge!r}")
    if shared is not None:
        check_tensor("kv_start", shared.kv_start, ndim=1, dtype=torch.int32, device=q.device)
        check_tensor("part_out", shared.part_out, ndim=3, dtype=torch.float32, device=q.device)
        check_tensor("part_lse", shared.part_lse, ndim=2, dtype=torch.float32, device=q.device)
        if not (shared.kv_start.shape[0] >= batch and shared.part_out.shape[0] >= batch
                and shared.part_lse.shape[0] >= batch):
            fail("shared", f"kv_start, part_out and part_lse need a row per sequence ({batch})")
        if num_splits > 1 and merge == "fused":
            fail("shared", "a shared-prefix pass is merged by the merge kernel: use merge='kernel'")
    if direct_single and num_splits > 1 and merge == "fused":
        fail("direct_single", "works with the merge kernel only: use merge='kernel'")
    if batch == 0:
        return out
    block_n = block_n or DEFAULT_BLOCK_N
    min_tiles = max(1, -(-(split_tokens or DEFAULT_SPLIT_TOKENS) // block_n))
    num_warps = num_warps or DEFAULT_NUM_WARPS
    num_stages = num_stages or DEFAULT_NUM_STAGES
    g = hq // hkv
    d_pad = next_pow2(d)
    if num_splits > 1:
        part_out = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    fused = num_splits > 1 and merge == "fused"
    counters = _merge_counters(q.device, batch * hkv) if fused else seq_lens  # unused unless fused
    pstr = (hq * num_splits, num_splits, 1)
    kv_start, pre_out, pre_lse = shared if shared is not None else (seq_lens, out, out)   # unused unless shared
    _decode_kernel[(batch, hkv, num_splits)](
        q, kv_cache, block_tables, seq_lens, query_start_loc,
        out, part_out, part_lse, counters, kv_start, pre_out, pre_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        *pstr,
        G=g, G_PAD=max(16, next_pow2(g)), HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_TILES=min_tiles,
        FUSED_MERGE=fused, NUM_KV_HEADS=hkv, S_PAD=next_pow2(num_splits), SHARED=shared is not None,
        UPCAST=upcast_dots(q.dtype), PREC=dot_precision(q.dtype), DIRECT_SINGLE=direct_single and num_splits > 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and not fused:
        _merge_kernel[(batch, hq)](
            out, part_out, part_lse, query_start_loc, seq_lens, kv_start, pre_out, pre_lse,
            out.stride(0), out.stride(1), *pstr,
            HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, S_PAD=next_pow2(num_splits),
            NUM_Q_HEADS=hq, SHARED=shared is not None,
            DIRECT_SINGLE=direct_single, BLOCK_N=block_n, MIN_TILES=min_tiles,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch reference for decode and prefill alike (float32 math, causal).

    Query token ``i`` of sequence ``b`` sits at position ``seq_len - q_len + i`` and
    attends to positions ``0..pos`` read through the block table.
    """
    _, _, block_size, hkv, d = kv_cache.shape
    hq = q.shape[1]
    g = hq // hkv
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[b], qsl[b + 1]
        if q1 == q0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        flat = kv_cache.view(2, -1, hkv, d)
        k = flat[0, slots].float().repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = flat[1, slots].float().repeat_interleave(g, dim=1)
        qb = q[q0:q1].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qb, k) * scale
        qpos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
    return out.to(q.dtype)
