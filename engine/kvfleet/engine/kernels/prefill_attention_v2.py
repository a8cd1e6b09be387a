"""Causal prefill attention over the paged KV cache, second version (issue 16's long-prompt row).

Same inputs and results as `prefill_attention` (v1), arranged the way FlashAttention-style Triton kernels run
fast on Hopper:

* the key loop is split in two: the keys below the tile's first query position are seen by every row of the
  tile, so that part runs with no causal ``where`` and no key mask (the bulk of a long prompt's work); only the
  last one or two key tiles (the diagonal) are masked (the fused-attention tutorial's STAGE split);
* the softmax scale is folded into log2 space once and applied by one multiply-subtract per score; the
  ``P @ V`` product accumulates in place (``tl.dot(p, v, acc)``);
* one flat grid with the query head fastest: the G query heads of a KV head, and the heads of neighbouring
  query tiles, run side by side and read the same K/V tiles from L2;
* the work list comes heaviest first (``prefill_work(..., seq_lens=...)``: most keys first), so a causal
  prompt's long last tiles do not start last and leave the GPU idle at the tail; without a list, the
  program order still runs the last query tiles first.

Optionally (``k``/``v`` given) the keys and values of the step's new tokens are read from its contiguous K/V
projections instead of through the block table (all of a fresh prompt's; a chunk's own, after its cached
prefix's through the block table); on Hopper those tiles come by TMA (tensor descriptors), the way the
tutorial's kernel loads them. The paged cache's keys are gathered row by row through the block table, unless a
key tile fits inside a block (blocks of 64 tokens and more: `cache_tma_applies`): then each tile is one TMA box
at its block's rows, the block table read once per tile (a chunk's cached prefix, a prefix-cache hit).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import (
    check_paged_attention_args,
    check_prefill_work,
    check_tensor,
    dot_precision,
    fail,
    interpret_mode,
    next_pow2,
    upcast_dots,
)

LOG2E = 1.4426950408889634


# where a sequence's keys and values are read from (`_attend`'s SRC): the paged cache through the block table
# (row by row, or PAGED_TMA: a whole block's rows per TMA box, when a key tile never crosses a block), or the
# step's contiguous k/v projections (pointer loads, or TMA boxes)
PAGED, CONTIG, CONTIG_TMA, PAGED_TMA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _load_rows(ptrs, nmask, dmask, N_MASK: tl.constexpr, D_MASK: tl.constexpr):
    if N_MASK:
        if D_MASK:
            return tl.load(ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
        return tl.load(ptrs, mask=nmask[:, None], other=0.0)
    if D_MASK:
        return tl.load(ptrs, mask=dmask[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, q_pos, n0, hi, arange_n, k_base, v_base, k_desc, v_desc, bt_row, kv_row0, kvh,
                 d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt, stride_vt,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_MASK: tl.constexpr, UPCAST: tl.constexpr,
                 PREC: tl.constexpr, MASKED: tl.constexpr, SRC: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) of `_attend`'s loop."""
    offs_n = n0 + arange_n
    nmask = offs_n < hi
    if SRC == CONTIG_TMA or SRC == PAGED_TMA:
        # TMA boxes: of the contiguous k/v (rows past the sequence are the next one's, or zeros), or of one
        # cache block's rows (past the sequence: stale slots of its last block)
        if SRC == PAGED_TMA:
            row = tl.load(bt_row + n0 // BLOCK_SIZE) * BLOCK_SIZE + n0 % BLOCK_SIZE
        else:
            row = kv_row0 + n0
        k = k_desc.load([row, kvh * HEAD_DIM])
        v = v_desc.load([row, kvh * HEAD_DIM])
        if MASKED:
            v = tl.where(nmask[:, None], v, 0.0)   # p is 0 there; keep a stray inf or nan from making 0 * inf
    else:
        if SRC == CONTIG:
            tok = (kv_row0 + offs_n).to(tl.int64)
            k_row = tok * stride_kt
            v_row = tok * stride_vt
        else:
            if MASKED:
                blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
            k_row = blk * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_slot
            v_row = k_row
        k = _load_rows(k_base + k_row[:, None] + d[None, :], nmask, dmask, MASKED, D_MASK)
        v = _load_rows(v_base + v_row[:, None] + d[None, :], nmask, dmask, MASKED, D_MASK)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        # every row sees key ``lo`` (<= its position) in the first diagonal tile: m_new is finite
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & nmask[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        p = tl.math.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, lo, hi, k_base, v_base, k_desc, v_desc, bt_row, kv_row0, kvh, d, dmask,
            scale_log2, stride_c_blk, stride_c_slot, stride_kt, stride_vt,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_MASK: tl.constexpr,
            UPCAST: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr, SRC: tl.constexpr,
            LOOP_STAGES: tl.constexpr):
    """Online softmax over key positions [lo, hi) in BLOCK_N tiles. MASKED: the diagonal (causal mask, keys
    past ``hi`` masked); otherwise every key is visible to every row and nothing is masked. SRC: PAGED reads
    through the block table, PAGED_TMA too but a tile at once from the cache's descriptors (BLOCK_N divides
    BLOCK_SIZE); CONTIG/CONTIG_TMA read key position n at row ``kv_row0 + n`` of k/v. LOOP_STAGES > 0: this
    loop's software-pipeline depth instead of the launch's ``num_stages`` (the cache loops: their tile's
    address is itself a load, so the pipeliner gives K/V one stage less, see `cache_stages`)."""
    arange_n = tl.arange(0, BLOCK_N)
    if LOOP_STAGES > 0:
        for n0 in tl.range(lo, hi, BLOCK_N, num_stages=LOOP_STAGES):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, n0, hi, arange_n, k_base, v_base, k_desc, v_desc,
                                         bt_row, kv_row0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot,
                                         stride_kt, stride_vt, HEAD_DIM, BLOCK_SIZE, D_MASK, UPCAST, PREC, MASKED,
                                         SRC)
    else:
        for n0 in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, n0, hi, arange_n, k_base, v_base, k_desc, v_desc,
                                         bt_row, kv_row0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot,
                                         stride_kt, stride_vt, HEAD_DIM, BLOCK_SIZE, D_MASK, UPCAST, PREC, MASKED,
                                         SRC)
    return acc, l_i, m_i


@triton.jit
def _attend_causal(acc, l_i, m_i, q, q_pos, ctx, q_first, end_n, c_base, k_base, v_base, k_desc, v_desc, kc_desc,
                   vc_desc, bt_row, q_start, kvh, d, dmask, scale_log2, stride_c_kv, stride_c_blk, stride_c_slot,
                   stride_kt, stride_vt,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D_MASK: tl.constexpr,
                   UPCAST: tl.constexpr, PREC: tl.constexpr, NEW_SRC: tl.constexpr, CACHE_SRC: tl.constexpr,
                   CACHE_STAGES: tl.constexpr):
    """Every key of a query tile whose first query sits at position ``q_first`` (>= ctx), its last key
    ``end_n - 1``: keys below ``q_first`` are seen by every row of the tile (no causal mask), the rest form the
    diagonal. NEW_SRC PAGED: every key from the cache (CACHE_SRC: PAGED or PAGED_TMA), whole unmasked key tiles
    up to ``q_first`` rounded down, then the diagonal. Otherwise the ``ctx`` cached keys come from the cache (the
    last partial tile masked at ``ctx`` only) and the step's new keys from k/v, counted from ``ctx`` so that
    their unmasked tiles are whole too. CACHE_STAGES: the unmasked cache loop's pipeline depth (0: the
    launch's)."""
    if NEW_SRC == PAGED:
        full_end = (q_first // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, 0, full_end, c_base, c_base + stride_c_kv, kc_desc, vc_desc,
                                bt_row, 0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                                stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, False, CACHE_SRC,
                                CACHE_STAGES)
        return _attend(acc, l_i, m_i, q, q_pos, full_end, end_n, c_base, c_base + stride_c_kv, kc_desc, vc_desc,
                       bt_row, 0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                       stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, True, CACHE_SRC, 0)
    ctx_full = (ctx // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, 0, ctx_full, c_base, c_base + stride_c_kv, kc_desc, vc_desc,
                            bt_row, 0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                            stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, False, CACHE_SRC,
                            CACHE_STAGES)
    # the cached keys' last partial tile: every row sees them all, masked only past ctx
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, ctx_full, ctx, c_base, c_base + stride_c_kv, kc_desc, vc_desc,
                            bt_row, 0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                            stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, True, CACHE_SRC, 0)
    new_full = ctx + ((q_first - ctx) // BLOCK_N) * BLOCK_N
    kv_row0 = q_start - ctx   # key position n of this step's tokens is row q_start + (n - ctx) of k/v
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, ctx, new_full, k_base, v_base, k_desc, v_desc,
                            bt_row, kv_row0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                            stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, False, NEW_SRC, 0)
    return _attend(acc, l_i, m_i, q, q_pos, new_full, end_n, k_base, v_base, k_desc, v_desc,
                   bt_row, kv_row0, kvh, d, dmask, scale_log2, stride_c_blk, stride_c_slot, stride_kt,
                   stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, True, NEW_SRC, 0)


# stride_bt, batch and num_tiles change from step to step: specializing on them (== 1, multiple of 16) would
# compile new variants on live requests' time (issue 16's TTFT p99); nothing in the kernel gains from it.
@triton.jit(do_not_specialize=["stride_bt", "batch", "num_tiles"])
def _prefill_kernel_v2(
    q_ptr, cache_ptr, k_ptr, v_ptr, k_desc, v_desc, kc_desc, vc_desc, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, work_ptr,
    scale_log2, batch, num_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, stride_bt, stride_kt, stride_kh, stride_vt, stride_vh,
    HQ: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SKIP_DECODE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, USE_WORK: tl.constexpr,
    HAS_KV: tl.constexpr, KV_TMA: tl.constexpr, CACHE_TMA: tl.constexpr, CACHE_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    h = pid % HQ          # query head fastest: programs sharing K/V tiles run together (L2)
    w = pid // HQ
    if USE_WORK:          # (sequence, query tile), heaviest first
        b = tl.load(work_ptr + 2 * w)
        tile = tl.load(work_ptr + 2 * w + 1)
    else:                 # every (tile, sequence) pair, the last (longest) query tiles first
        b = w % batch
        tile = num_tiles - 1 - w // batch
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
    D_MASK: tl.constexpr = HEAD_DIM != D_PAD

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    mmask = offs_m < q_len
    dmask = d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = _load_rows(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mmask, dmask, True, D_MASK)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = ctx + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    q_first = ctx + tile * BLOCK_M                           # the tile's first query position
    end_n = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)  # one past its last key
    c_base = cache_ptr + kvh * stride_c_head
    NEW_SRC: tl.constexpr = (CONTIG_TMA if KV_TMA else CONTIG) if HAS_KV else PAGED
    CACHE_SRC: tl.constexpr = PAGED_TMA if CACHE_TMA else PAGED
    acc, l_i, m_i = _attend_causal(
        acc, l_i, m_i, q, q_pos, ctx, q_first, end_n, c_base, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh,
        k_desc, v_desc, kc_desc, vc_desc, bt_row, q_start, kvh, d, dmask, scale_log2, stride_c_kv, stride_c_blk,
        stride_c_slot, stride_kt, stride_vt, HEAD_DIM, BLOCK_SIZE, BLOCK_N, D_MASK, UPCAST, PREC, NEW_SRC,
        CACHE_SRC, CACHE_STAGES)

    out = acc / l_i[:, None]   # l_i >= 1: the row's maximum contributes exp2(0)
    ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    if D_MASK:
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
    else:
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


@functools.lru_cache(maxsize=8)
def _tma_device(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return interpret_mode()


def tma_applies(k: torch.Tensor, v: torch.Tensor, block_n: int) -> bool:
    """Whether k/v ``[T, Hkv, D]`` can be read by 2-D tensor descriptors ``[T, Hkv * D]`` of ``[block_n, D]`` boxes."""
    d = k.shape[2]
    if not _tma_device(k.device):
        return False
    es = k.element_size()
    return (d == next_pow2(d) and d * es >= 16 and block_n <= 256 and d <= 256
            and all(t.stride(2) == 1 and t.stride(1) == d and (t.stride(0) * es) % 16 == 0
                    and t.data_ptr() % 16 == 0 for t in (k, v)))


def cache_tma_applies(kv_cache: torch.Tensor, block_n: int) -> bool:
    """Whether the paged cache ``[2, blocks, block_size, Hkv, D]`` can be read a key tile at a time by 2-D tensor
    descriptors over each half, ``[blocks * block_size, Hkv * D]`` with ``[block_n, D]`` boxes: a tile must not
    cross a block (``block_n`` divides the block size), the block's rows must follow each other in memory."""
    _, nb, bs, hkv, d = kv_cache.shape
    if not _tma_device(kv_cache.device) or bs % block_n != 0:
        return False
    es = kv_cache.element_size()
    s_kv, s_blk, s_slot, s_head, s_d = kv_cache.stride()
    return (d == next_pow2(d) and d * es >= 16 and block_n <= 256 and d <= 256 and s_d == 1 and s_head == d
            and s_slot == hkv * d and s_blk == bs * s_slot and (s_slot * es) % 16 == 0
            and (s_kv * es) % 16 == 0 and kv_cache.data_ptr() % 16 == 0)


def _cache_descriptors(kv_cache: torch.Tensor, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The K and V halves of the cache as ``[blocks * block_size, Hkv * D]`` rows, ``[block_n, D]`` boxes."""
    _, nb, bs, hkv, d = kv_cache.shape
    k_desc, v_desc = (TensorDescriptor(kv_cache[i], [nb * bs, hkv * d], [kv_cache.stride(2), 1], [block_n, d])
                      for i in (0, 1))
    return k_desc, v_desc


# Steps whose longest query is at most this many tokens take the short-query tile (`default_tile_v2`).
SHORT_QUERY_MAX_TOKENS = 2048


def default_tile_v2(max_query_len: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): for long chunks in 16-bit, 128-row tiles over two warpgroups
    (one wgmma M=64 block each; with 4 warps the 128-row tile spills registers on sm_90:
    `bench/prefill_kernel_resources.py`); for queries of 17..2,048 tokens 64 x 32 tiles in one warpgroup (168
    registers, 66 KB: three programs an SM hide each other's set-up, which a prompt of ~1k tokens, ~9 key
    tiles a program, cannot amortize: issue 16's lease 9 sweep, 184 against 167 TFLOP/s at 8 x 1024, 236
    against 202 at 16 x 1024, 400 against 470 at 1 x 8192); 16 rows for chunks of up to 16 tokens; 32 in
    float32 (the interpreter's tests)."""
    if max_query_len <= 16:
        return 16, 64, 4, 2
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if max_query_len <= SHORT_QUERY_MAX_TOKENS:
        return 64, 32, 4, 3
    return 128, 64, 8, 3


def prefill_attention_v2(
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
    block_n: int | None = None,
    work: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    kv_tma: bool | None = None,
    cache_tma: bool | None = None,
    cache_stages: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of ``q`` ``[T, Hq, D]`` over the paged cache into ``out`` (as v1's).

    ``work``: optional ``prefill_work(...)`` list built with the same ``block_m`` and ``skip_decode`` (pass
    ``seq_lens`` to it for the heaviest-first order); without it the grid covers every (tile, sequence) pair.
    ``k``/``v`` ``[T, Hkv, D]`` (both or neither): the step's new keys and values, as written into the cache;
    each sequence reads its new tokens' keys from them and only its cached prefix through the block table.
    ``kv_tma``: with ``k``/``v``, load their tiles with TMA (tensor descriptors; Hopper's bulk copies, which
    Triton pipelines without address arithmetic); None: where it applies (a power-of-two head dim, 16-byte
    aligned rows; on CUDA a device of compute capability >= 9). ``cache_tma``: read the cached keys (every key
    without k/v) a tile at a time by TMA from the cache's blocks (`cache_tma_applies`: blocks of a multiple of
    ``block_n`` tokens); None: where it applies. Tile arguments left as None take `default_tile_v2`'s.
    ``cache_stages``: the software-pipeline depth of the loop over cached keys (0 or None: ``num_stages``, as
    every other loop). That loop's tile address is a block-table load, which Triton's pipeliner puts a stage
    ahead of the K/V loads, so at ``num_stages`` 3 the K/V tiles get two buffers and are issued one iteration
    ahead, after the previous tile's math (its latency is exposed: sm_90 TTGIR); ``num_stages + 1`` gives them
    the three buffers and two-tile lead the loops over new keys have, at the same shared memory.
    """
    block_size, hkv, d, hq, batch = check_paged_attention_args(q, out, kv_cache, block_tables, seq_lens,
                                                                query_start_loc)
    if not (max_query_len >= 0):
        fail("max_query_len", "must be >= 0")
    if batch == 0 or max_query_len == 0:
        return out
    dm, dn, dw, ds = default_tile_v2(max_query_len, q.dtype)
    block_m = dm if block_m is None else block_m
    block_n = dn if block_n is None else block_n
    num_warps = dw if num_warps is None else num_warps
    num_stages = ds if num_stages is None else num_stages
    cache_stages = 0 if cache_stages is None else cache_stages
    if not (0 <= cache_stages <= 8):
        fail("cache_stages", f"must be in 0..8, got {cache_stages}")
    if (k is None) != (v is None):
        fail("k" if k is None else "v", "k and v come together")
    if k is not None and v is not None:
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtype=q.dtype, device=q.device)
            if not (t.shape == (q.shape[0], hkv, d)):
                fail(name, f"expected shape {(q.shape[0], hkv, d)}, got {tuple(t.shape)}")
    num_tiles = triton.cdiv(max_query_len, block_m)
    if work is not None:
        if check_prefill_work(work, q.device) == 0:
            return out
        programs = work.shape[0] * hq
    else:
        programs = num_tiles * batch * hq
    contig = k is not None and v is not None
    tma_ok = k is not None and v is not None and tma_applies(k, v, block_n)
    if kv_tma and not tma_ok:
        fail("kv_tma", "needs k/v with a power-of-two head dim, 16-byte aligned rows and a TMA-capable device")
    use_tma = tma_ok if kv_tma is None else kv_tma
    k_desc = v_desc = kc_desc = vc_desc = q   # placeholder arguments: a variant without TMA never reads them
    if use_tma and k is not None and v is not None:
        k_desc, v_desc = (TensorDescriptor(t, [t.shape[0], hkv * d], [t.stride(0), 1], [block_n, d]) for t in (k, v))
    cache_ok = cache_tma_applies(kv_cache, block_n)
    if cache_tma and not cache_ok:
        fail("cache_tma", "needs cache blocks of a multiple of block_n tokens, a power-of-two head dim, 16-byte "
                          "aligned rows and a TMA-capable device")
    use_cache_tma = cache_ok if cache_tma is None else cache_tma
    if use_cache_tma:
        kc_desc, vc_desc = _cache_descriptors(kv_cache, block_n)
    _prefill_kernel_v2[(programs,)](
        q, kv_cache, k if contig else q, v if contig else q, k_desc, v_desc, kc_desc, vc_desc, block_tables, seq_lens,
        query_start_loc, out,
        work if work is not None else seq_lens,
        scale * LOG2E, batch, num_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        k.stride(0) if k is not None else 0, k.stride(1) if k is not None else 0,
        v.stride(0) if v is not None else 0, v.stride(1) if v is not None else 0,
        HQ=hq, G=hq // hkv, HEAD_DIM=d, D_PAD=next_pow2(d),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        SKIP_DECODE=skip_decode, UPCAST=upcast_dots(q.dtype), PREC=dot_precision(q.dtype),
        USE_WORK=work is not None, HAS_KV=contig, KV_TMA=use_tma, CACHE_TMA=use_cache_tma,
        CACHE_STAGES=cache_stages if cache_stages != num_stages else 0, num_warps=num_warps, num_stages=num_stages,
    )
    return out
