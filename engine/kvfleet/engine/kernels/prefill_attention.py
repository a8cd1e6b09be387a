"""Causal attention for prefill and chunked prefill over the paged KV cache.

The new tokens' K/V are written into the cache first (``reshape_and_cache``), so
this kernel reads every key (the cached prefix and the new chunk alike) through
the block table. Query tile ``t`` of sequence ``b`` for query head ``h`` is one
program; query token ``i`` sits at position ``seq_len - q_len + i`` and sees keys
``0..pos``. Sequences with exactly one query token are skipped when
``skip_decode`` is set (the decode kernel serves them in the same step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import check_paged_attention_args, check_prefill_work, dot_precision, fail, next_pow2, upcast_dots

LOG2E = 1.4426950408889634


# The block-table width changes from step to step: specializing on it (== 1, multiple of 16) would compile
# new variants on live requests' time (issue 16's TTFT p99); nothing in the kernel gains from it.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr, work_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, USE_WORK: tl.constexpr,
):
    if USE_WORK:  # compact list of (sequence, query tile): no programs wasted on short or decode sequences
        b = tl.load(work_ptr + 2 * tl.program_id(0))
        tile = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
        h = tl.program_id(1)
    else:
        tile = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    kvh = h // G

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    mmask = offs_m < q_len
    dmask = d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_c_head
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    end_n = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
    for n0 in range(0, end_n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end_n
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = blk * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_slot
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        causal = (offs_n[None, :] <= q_pos[:, None]) & nmask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def default_block_m(max_query_len: int, dtype: torch.dtype) -> int:
    return 16 if max_query_len <= 16 else (64 if dtype != torch.float32 else 32)


def prefill_work_pairs(query_start_loc_cpu: list[int], block_m: int, skip_decode: bool,
                       seq_lens_cpu: list[int] | None = None, only: Sequence[bool] | None = None) -> list[int]:
    """Flat ``[seq, tile, seq, tile, ...]``: the (sequence, query tile) pairs that have work, from the host copy
    of query_start_loc (pure; `prefill_work` puts it on the device).

    With ``seq_lens_cpu`` the pairs come heaviest first (most keys to read: cached prefix plus the tile's
    causal span), so the longest programs of a causal prompt start first instead of last (v2's order).
    ``only``: one flag a sequence; those without it get no work (another kernel attends for them)."""
    pairs: list[tuple[int, int]] = []
    for b in range(len(query_start_loc_cpu) - 1):
        q_len = query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]
        if q_len == 0 or (skip_decode and q_len == 1) or (only is not None and not only[b]):
            continue
        pairs += ((b, t) for t in range(-(-q_len // block_m)))
    if seq_lens_cpu is not None:
        def keys(pair: tuple[int, int]) -> int:
            b, t = pair
            q_len = query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]
            return seq_lens_cpu[b] - q_len + min((t + 1) * block_m, q_len)
        pairs.sort(key=keys, reverse=True)   # stable: ties keep sequence order
    return [x for pair in pairs for x in pair]


def prefill_work(query_start_loc_cpu: list[int], block_m: int, skip_decode: bool,
                 device: torch.device | str, seq_lens_cpu: list[int] | None = None,
                 only: Sequence[bool] | None = None) -> torch.Tensor:
    """int32 ``[n, 2]`` (sequence, query tile) pairs that have work (`prefill_work_pairs`) on ``device``. The copy
    goes through pinned memory: one from pageable memory would wait for every kernel queued before it (with async
    scheduling, the whole previous step)."""
    flat = torch.tensor(prefill_work_pairs(query_start_loc_cpu, block_m, skip_decode, seq_lens_cpu, only),
                        dtype=torch.int32).view(-1, 2)
    if torch.device(device).type == "cpu":
        return flat
    return flat.pin_memory().to(device, non_blocking=True)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    skip_decode: bool = False,
    block_m: int | None = None,
    block_n: int = 64,
    work: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal varlen attention of ``q`` ``[T, Hq, D]`` over the paged cache into ``out``.

    ``work``: optional ``prefill_work(...)`` list built with the same ``block_m`` and
    ``skip_decode``; without it the grid covers every (tile < max tiles, sequence) pair.
    """
    block_size, hkv, d, hq, batch = check_paged_attention_args(q, out, kv_cache, block_tables, seq_lens,
                                                                query_start_loc)
    if not (max_query_len >= 0):
        fail("max_query_len", "must be >= 0")
    if batch == 0 or max_query_len == 0:
        return out
    if block_m is None:
        block_m = default_block_m(max_query_len, q.dtype)
    if work is not None:
        if check_prefill_work(work, q.device) == 0:
            return out
        grid: tuple[int, ...] = (work.shape[0], hq)
    else:
        grid = (triton.cdiv(max_query_len, block_m), batch, hq)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out, work if work is not None else seq_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        G=hq // hkv, HEAD_DIM=d, D_PAD=next_pow2(d),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SKIP_DECODE=skip_decode, UPCAST=upcast_dots(q.dtype), PREC=dot_precision(q.dtype),
        USE_WORK=work is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return out
