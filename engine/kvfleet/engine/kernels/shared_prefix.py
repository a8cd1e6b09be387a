"""Attention of decode queries over a KV prefix that several sequences share (cascade attention's first level).

Many decoding sequences can share their leading KV blocks: a system prompt found in the prefix cache, or the
prompt of a request sampled n times. The decode kernel reads every sequence's whole context, so a prefix
shared by 64 sequences is read 64 times a layer. Here one program takes up to ``BLOCK_M // G`` of those
sequences (all ``G`` query heads of one KV head each, ``BLOCK_M`` query rows in all) and reads each prefix tile
once for them. It writes a normalized partial output and its log2-sum-exp per (sequence, query head); the
decode kernel then reads each sequence's keys from the end of its prefix on and folds the partial in
(`paged_decode_attention(..., shared=...)`).

The work list (`items`, int32 [K, 4]: a row whose block table holds the prefix, the prefix's length in
tokens, the item's first index in `members`, its member count) has a fixed capacity, so a CUDA graph can be
captured over it; entries with no member do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor, dot_precision, fail, next_pow2, upcast_dots
from .paged_decode import attend_paged_tile

LOG2E = 1.4426950408889634
ITEM_FIELDS = 4          # representative row, prefix tokens, first member, member count
DEFAULT_BLOCK_M = 64     # query rows a program takes: 16 sequences of a GQA group of 4
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


def members_per_item(num_q_heads: int, num_kv_heads: int, block_m: int = DEFAULT_BLOCK_M) -> int:
    """How many sequences one program takes: its query rows hold every query head of one KV head for each."""
    return max(1, block_m // (num_q_heads // num_kv_heads))


@triton.jit(do_not_specialize=["stride_bt"])
def _shared_prefix_kernel(
    q_ptr, cache_ptr, block_tables_ptr, qsl_ptr, items_ptr, members_ptr, po_ptr, plse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    G: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    count = tl.load(items_ptr + item * 4 + 3)
    if count == 0:
        return
    rep = tl.load(items_ptr + item * 4)
    prefix_len = tl.load(items_ptr + item * 4 + 1)
    first = tl.load(items_ptr + item * 4 + 2)

    r = tl.arange(0, BLOCK_M)
    member = r // G
    head = kvh * G + r % G
    rmask = member < count
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    seq = tl.load(members_ptr + first + member, mask=rmask, other=0)
    q_row = tl.load(qsl_ptr + seq, mask=rmask, other=0).to(tl.int64)   # a decode sequence's one query token
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_c_head
    bt_row = block_tables_ptr + rep.to(tl.int64) * stride_bt
    # every prefix key precedes every member's query: no causal mask, only the prefix's end
    for n0 in range(0, prefix_len, BLOCK_N):
        m_i, l_i, acc = attend_paged_tile(q, m_i, l_i, acc, k_base, bt_row, n0, prefix_len, d, dmask, scale_log2,
                                          stride_c_kv, stride_c_blk, stride_c_slot,
                                          BLOCK_SIZE, BLOCK_N, UPCAST, PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    base = seq.to(tl.int64) * NUM_Q_HEADS + head
    tl.store(po_ptr + base[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
             mask=rmask[:, None] & dmask[None, :])
    tl.store(plse_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe)), mask=rmask)


def shared_prefix_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    items: torch.Tensor,
    members: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
) -> None:
    """Write, for every member sequence ``b`` of every item, the attention of its decode query over its item's
    prefix: ``part_out[b]`` [Hq, D] (float32, normalized) and ``part_lse[b]`` [Hq] (log2-sum-exp of the
    scaled scores). Rows of sequences in no item are left as they are."""
    check_tensor("q", q, ndim=3)
    check_tensor("kv_cache", kv_cache, ndim=5, dtype=q.dtype, device=q.device)
    check_tensor("items", items, ndim=2, dtype=torch.int32, device=q.device)
    check_tensor("members", members, ndim=1, dtype=torch.int32, device=q.device)
    check_tensor("part_out", part_out, ndim=3, dtype=torch.float32, device=q.device)
    check_tensor("part_lse", part_lse, ndim=2, dtype=torch.float32, device=q.device)
    _, _, block_size, hkv, d = kv_cache.shape
    hq = q.shape[1]
    if not (items.shape[1] == ITEM_FIELDS):
        fail("items", f"expected [K, {ITEM_FIELDS}], got {tuple(items.shape)}")
    if not (part_out.shape[1:] == (hq, d) and part_lse.shape[1] == hq and part_out.shape[0] == part_lse.shape[0]):
        fail("part_out", f"expected [B, {hq}, {d}] and part_lse [B, {hq}], got {tuple(part_out.shape)}, "
                         f"{tuple(part_lse.shape)}")
    g = hq // hkv
    block_m = max(16, next_pow2(g * members_per_item(hq, hkv)))
    if items.shape[0] == 0:
        return
    _shared_prefix_kernel[(items.shape[0], hkv)](
        q, kv_cache, block_tables, query_start_loc, items, members, part_out, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        G=g, NUM_Q_HEADS=hq, HEAD_DIM=d, D_PAD=next_pow2(d), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, UPCAST=upcast_dots(q.dtype), PREC=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
