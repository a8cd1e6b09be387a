"""Causal prefill attention for fresh prompts, FlashAttention-3 style, in Gluon for Hopper (sm_90); a prototype.

Plain Triton cannot overlap the softmax of a key tile with the tensor cores: its pipeliner keeps a wgmma in
flight across a loop iteration only as the next iteration's accumulator of the same dot, so every score tile
``S = Q K^T`` is waited for right after it is issued. Gluon (``triton.experimental.gluon``) writes the
asynchronous warpgroup MMAs (``warpgroup_mma(..., is_async=True)``), their waits, the TMA loads and their
mbarriers by hand, and so can order them the way FlashAttention-3 does (its "intra-warpgroup overlap"):

* Q's tile is one TMA box (a 2-D descriptor over q as ``[T, Hq * D]``), K and V come in ``[block_n, D]`` boxes
  of 2-D descriptors over k/v as ``[T, Hkv * D]`` into two rings of ``num_buffers`` shared-memory buffers, one
  mbarrier per buffer and ring: a K buffer is free once its ``S`` MMA retires, a V buffer once its ``P V`` MMA
  does, and each is refilled right then with the tile ``num_buffers`` ahead;
* ``S = Q K^T`` reads both operands from shared memory (K transposed as a view); ``O += P V`` takes P from
  registers as the A operand (a ``DotOperandLayout`` of O's MMA layout: no shared-memory round trip);
* the softmax is online, in the log2 domain with the scale folded in (as v2); the key loop is split as v2's:
  the whole tiles below the query tile's first row run unmasked, the diagonal tile(s) masked. Keys past the
  prompt's end only ever appear on the diagonal (their TMA rows are the next prompt's, or zeros past T), where
  the causal mask hides them from every row that is written; rows past the end are never stored.

Two schedules of the key loop (``s_ahead``), both with the tensor cores busy during the softmax:

* ``s_ahead=False`` (FlashAttention-3's own order): iteration j issues ``S_j = Q K_j^T``, then
  ``O += P_{j-1} V_{j-1}``, waits for ``S_j`` only (``warpgroup_mma_wait(1)``: groups retire in order), runs
  ``softmax(S_j)`` while ``P_{j-1} V_{j-1}`` runs, then waits for it and rescales O. The ``Q K^T`` of each tile
  is exposed; registers: O, P_{j-1} and one score tile (245 at 128 x 128).
* ``s_ahead=True``: iteration j issues ``S_{j+1}`` and then ``P_{j-1} V_{j-1}`` before ``softmax(S_j)``, so both
  GEMMs run under it, then waits for both and rescales O. One more score tile and P in float32 (see
  `_step_ahead` for what ptxas needs): 227 registers at 128 x 64; at 128 x 128 it spills (default 64 keys).

Each program is one (prompt, query tile) pair for one query head, heaviest tiles first (`prefill_work`), the
query head fastest as in v2 (the heads of a KV head read the same K/V tiles from L2). 128-row tiles run in
two warpgroups (8 warps), 64 rows each: wgmma's M is 64 a warpgroup. Every warp reads every K/V buffer and
mbarrier, so Triton's shared-memory hazard analysis puts CTA barriers (``bar.sync``, about four an iteration)
around each refill's TMA and before the barrier waits: the two warpgroups run in lock step, softmax beside
softmax, where FlashAttention-3 lets them drift and even orders them (one's GEMMs under the other's softmax).

``warp_specialize=True``: one producer warp (``gl.warp_specialize``,
24 registers) issues the TMA refills once the consumer has signalled the slot's "free" mbarrier (where the
single-partition kernel refills); the kernel's warps only wait for tiles and compute. Gluon's ``mbarrier.arrive``
is one thread's, so each "free" signal still needs a barrier of the consumer's 8 warps first (3 an iteration
instead of 4).

``consumers=2`` (with ``warp_specialize``): the two warpgroups as two consumer partitions, 64 query rows each, each
waiting on its own and arriving on its own at the "free" mbarriers (counts of 2), with barriers of its own four
warps only: they may drift apart. ``pingpong=True`` orders them as FlashAttention-3 does: the two take turns to
issue their MMAs (two "turn" mbarriers, `_take_turn`), so one warpgroup's softmax runs while the other's MMAs do.
On an H100 the free pair is the fastest (`TWO_WARPGROUPS_TILE`, the engine's default). Not done: a persistent grid,
head dims other than 64 and 128.

``PAGED`` (`prefill_attention_gluon_paged`): chunks over a cached prefix. Every key comes from the paged cache, by
descriptors whose box is one cache block: a key tile is ``block_n / block_size`` copies into row slices of its ring
buffer, their block numbers read from the sequence's block-table row; query rows take absolute positions (cached
keys + row), so the key loop, its causal split and its mask are unchanged.

Gluon kernels cannot run under Triton's CPU interpreter: with ``TRITON_INTERPRET=1`` ``gluon.jit`` still builds
a compiled kernel (a ``GluonJITFunction``), whose launch on a machine without a GPU fails with "RuntimeError:
0 active drivers ([]). There should only be one." Correctness is checked on a GPU only
(``bench/gpu_gluon_attention_check.py``); on CPU the kernel is compiled for sm_90 and its resources and
instruction order are checked (``bench/gluon_attention_resources.py``,
``tests/engine_kernels/test_gluon_attention_sm90.py``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._common import check_paged_attention_args, check_prefill_work, check_tensor, fail

LOG2E = 1.4426950408889634
GLUON_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
HOPPER_MAX_SHARED = 232448   # bytes of shared memory a block may have on an H100/H200 (227 KiB)


# --------------------------------------------------------------------------------------------------------- kernel
# ``ring``: (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty): the K/V descriptors, the two rings of
# NUM_BUFFERS tiles, their "landed" mbarriers and (with WARP_SPEC) their "free" mbarriers, which the consumer
# signals and the producer partition waits on before refilling.
# ``src``: (row0, table_ptr, n_pages): where key tile j comes from. A fresh prompt's keys are rows ``row0 + j *
# block_n`` of k/v (descriptors with ``block_n``-row boxes: one copy a tile). A chunk's keys are its sequence's
# pages in the paged cache (descriptors with one-page boxes, shorter than the tile: one copy a page into its rows
# of the buffer), the page numbers from its block-table row ``table_ptr``, ``n_pages`` long.

@gluon.jit
def _slot(bufs, bars, j, NUM_BUFFERS: gl.constexpr):
    """Key tile j's ring slot: (its "landed" mbarrier, its buffer)."""
    idx = j % NUM_BUFFERS
    return bars.index(idx), bufs.index(idx)


@gluon.jit
def _load_tile(desc, bufs, bars, j, src, col, pred, NUM_BUFFERS: gl.constexpr):
    """TMA of key tile j into ring slot ``j % NUM_BUFFERS``, when ``pred`` (``src`` above)."""
    row0, table_ptr, n_pages = src
    BLOCK_N: gl.constexpr = bufs.shape[1]
    PIECES: gl.constexpr = BLOCK_N // desc.block_type.shape[0]
    BOX: gl.constexpr = desc.block_type.shape[0]
    bar, buf = _slot(bufs, bars, j, NUM_BUFFERS)
    mbarrier.expect(bar, desc.block_type.nbytes * PIECES, pred=pred)
    if PIECES == 1:
        tma.async_copy_global_to_shared(desc, [row0 + j * BLOCK_N, col], bar, buf, pred=pred)
    else:
        for i in gl.static_range(PIECES):
            # pages past the sequence's (in a tile that ends past its last key) read page 0: zeroed at start or
            # finite keys, which the causal mask hides from every row that is stored
            page = j * PIECES + i
            block = gl.load(table_ptr + page, mask=pred & (page < n_pages), other=0)
            tma.async_copy_global_to_shared(desc, [block * BOX, col], bar, buf.slice(i * BOX, BOX), pred=pred)


@gluon.jit
def _tile_pages(src, j, PIECES: gl.constexpr):
    """The cache blocks of a paged key tile j, all in one load (a producer warp's: one lane a block), for
    `_load_pages`; blocks past the sequence's read block 0 (as `_load_tile`)."""
    row0, table_ptr, n_pages = src
    offs = j * PIECES + gl.arange(0, PIECES, layout=gl.BlockedLayout([1], [32], [1], [0]))
    return gl.load(table_ptr + offs, mask=offs < n_pages, other=0)


@gluon.jit
def _load_pages(desc, bufs, bars, j, pages, col, NUM_BUFFERS: gl.constexpr):
    """TMA of paged key tile j into ring slot ``j % NUM_BUFFERS``, its blocks from `_tile_pages` (no table load
    between the copies: the K and V copies of a tile share one)."""
    BOX: gl.constexpr = desc.block_type.shape[0]
    PIECES: gl.constexpr = pages.shape[0]
    bar, buf = _slot(bufs, bars, j, NUM_BUFFERS)
    mbarrier.expect(bar, desc.block_type.nbytes * PIECES)
    lanes = gl.arange(0, PIECES, layout=pages.type.layout)
    for i in gl.static_range(PIECES):
        block = gl.sum(gl.where(lanes == i, pages, 0), 0)
        tma.async_copy_global_to_shared(desc, [block * BOX, col], bar, buf.slice(i * BOX, BOX))


@gluon.jit
def _wait_tile(bars, j, NUM_BUFFERS: gl.constexpr):
    """Until key tile j has landed in its ring slot (the slot's (j // NUM_BUFFERS)-th fill)."""
    mbarrier.wait(bars.index(j % NUM_BUFFERS), (j // NUM_BUFFERS) & 1)


@gluon.jit
def _free(desc, bufs, ready, empty, j, src, col, n_tiles, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr):
    """Key tile j's slot is no longer read (its MMA retired): refill it with tile j + NUM_BUFFERS, or (WARP_SPEC)
    tell the producer partition so."""
    pred = j + NUM_BUFFERS < n_tiles
    if WARP_SPEC:
        gl.thread_barrier()   # one thread arrives: both warpgroups' MMAs on the slot have retired by then
        mbarrier.arrive(empty.index(j % NUM_BUFFERS), pred=pred)
    else:
        _load_tile(desc, bufs, ready, j + NUM_BUFFERS, src, col, pred, NUM_BUFFERS)


@gluon.jit
def _free_k(ring, j, src, col, n_tiles, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr):
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    _free(k_desc, k_bufs, k_ready, k_empty, j, src, col, n_tiles, NUM_BUFFERS, WARP_SPEC)


@gluon.jit
def _free_v(ring, j, src, col, n_tiles, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr):
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    _free(v_desc, v_bufs, v_ready, v_empty, j, src, col, n_tiles, NUM_BUFFERS, WARP_SPEC)


@gluon.jit
def _issue_qk(q_smem, ring, j, S_LAYOUT: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """Issue ``S_j = Q K_j^T`` (both operands in shared memory) without waiting for it."""
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    _wait_tile(k_ready, j, NUM_BUFFERS)
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
    k = k_bufs.index(j % NUM_BUFFERS)
    return warpgroup_mma(q_smem, k.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, ring, j, o, NUM_BUFFERS: gl.constexpr):
    """Issue ``O += P_j V_j`` (P from registers) without waiting for it."""
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    _wait_tile(v_ready, j, NUM_BUFFERS)
    return warpgroup_mma(p, v_bufs.index(j % NUM_BUFFERS), o, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, n0, q_pos, scale_log2, MASKED: gl.constexpr, S_LAYOUT: gl.constexpr):
    """Online softmax of one score tile (keys from n0): -> (P in float32, in S's layout; alpha, l, m)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    if MASKED:
        # the diagonal: a row's keys past its own position (and the prompt's end) are hidden; every row sees
        # the tile's first key (n0 <= the query tile's first row), so m_new is finite
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where(offs_n[None, :] <= q_pos[:, None], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        p = gl.exp2(s * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _a_operand(p, P_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):
    """P as the A operand of ``P V`` (registers in O's MMA layout: no shared-memory round trip)."""
    return gl.convert_layout(p.to(DTYPE), P_LAYOUT)


@gluon.jit
def _rescale(o, alpha, O_LAYOUT: gl.constexpr):
    return o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]


@gluon.jit
def _take_turn(turns, k, C: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: before consumer C issues its MMAs of round k (S_0 is round 0, key tile j's step round j, the last
    P V round n_tiles), wait for the other consumer's round k - 1 (C = 1: round k) to have been issued. The two
    warpgroups issue their MMAs in turns, so one's softmax runs while the other's MMAs do (FlashAttention-3's
    ping-pong). A fresh mbarrier's "previous" phase (parity 1) counts as complete: consumer 0 starts."""
    if PINGPONG:
        mbarrier.wait(turns.index(C), (k & 1) ^ (1 - C))


@gluon.jit
def _pass_turn(turns, C: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: consumer C has issued this round's MMAs: the other consumer's turn (one arrival)."""
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - C))


@gluon.jit
def _step_fa3(q_smem, ring, turns, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col, scale_log2,
              MASKED: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
              NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr, C: gl.constexpr, PINGPONG: gl.constexpr):
    """FlashAttention-3's iteration j >= 1: S_j and P_{j-1} V_{j-1} issued, softmax(S_j) under the latter."""
    BLOCK_N: gl.constexpr = S_LAYOUT.instr_shape[1]
    _take_turn(turns, j, C, PINGPONG)
    s = _issue_qk(q_smem, ring, j, S_LAYOUT, NUM_BUFFERS)
    acc = _issue_pv(p, ring, j - 1, o, NUM_BUFFERS)
    _pass_turn(turns, C, PINGPONG)
    s = warpgroup_mma_wait(1, deps=[s])            # S_j retired (issued first); P_{j-1} V_{j-1} still runs
    _free_k(ring, j, src, kv_col, n_tiles, NUM_BUFFERS, WARP_SPEC)
    p_new, alpha, l_i, m_i = _softmax(s, m_i, l_i, j * BLOCK_N, q_pos, scale_log2, MASKED, S_LAYOUT)
    p_new = _a_operand(p_new, P_LAYOUT, q_smem.dtype)
    o, p = warpgroup_mma_wait(0, deps=[acc, p])     # P_{j-1}'s registers stay live until its MMA retires
    _free_v(ring, j - 1, src, kv_col, n_tiles, NUM_BUFFERS, WARP_SPEC)
    return _rescale(o, alpha, O_LAYOUT), p_new, m_i, l_i


@gluon.jit
def _step_ahead(q_smem, ring, s, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col, scale_log2,
                MASKED: gl.constexpr, HAS_PREV: gl.constexpr, HAS_NEXT: gl.constexpr, S_LAYOUT: gl.constexpr,
                O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr):
    """Iteration j of the ``s_ahead`` schedule. In: S_j (retired), O (rescaled for P_{j-1}) and P_{j-1} (float32).
    Issues Q K_{j+1}^T, then O += P_{j-1} V_{j-1}, runs softmax(S_j) under both, waits for both and rescales O for
    P_j: nothing is in flight across iterations.

    What ptxas needs to keep the overlap (sm_90 SASS, `bench/gluon_attention_resources.py`): O is rescaled only
    after a ``wait(0)`` (after a ``wait(1)`` whose retired MMA was issued in the previous iteration it serializes
    every wgmma of the kernel: C7514); P is carried in float32 and packed to bf16 right before its MMA (carried
    packed, ptxas gives P_j the registers P_{j-1}'s in-flight MMA reads and waits for it before the softmax)."""
    BLOCK_N: gl.constexpr = S_LAYOUT.instr_shape[1]
    if HAS_NEXT:
        s_next = _issue_qk(q_smem, ring, j + 1, S_LAYOUT, NUM_BUFFERS)
    if HAS_PREV:
        p = _a_operand(p, P_LAYOUT, q_smem.dtype)
        acc = _issue_pv(p, ring, j - 1, o, NUM_BUFFERS)
    p_new, alpha, l_i, m_i = _softmax(s, m_i, l_i, j * BLOCK_N, q_pos, scale_log2, MASKED, S_LAYOUT)
    if HAS_PREV:
        if HAS_NEXT:
            o, p, s = warpgroup_mma_wait(0, deps=[acc, p, s_next])
        else:
            o, p = warpgroup_mma_wait(0, deps=[acc, p])
        _free_v(ring, j - 1, src, kv_col, n_tiles, NUM_BUFFERS, WARP_SPEC)
    else:
        s = warpgroup_mma_wait(0, deps=[s_next])
    if HAS_NEXT:
        _free_k(ring, j + 1, src, kv_col, n_tiles, NUM_BUFFERS, WARP_SPEC)
    return s, _rescale(o, alpha, O_LAYOUT), p_new, m_i, l_i


@gluon.jit
def _attend_fa3(q_smem, ring, turns, s, q_pos, n_full, n_tiles, src, kv_col, scale_log2, S_LAYOUT: gl.constexpr,
                O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr,
                C: gl.constexpr, PINGPONG: gl.constexpr):
    """The key loop in FlashAttention-3's order, from S_0 (retired): -> (O unnormalized, l)."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    HEAD_DIM: gl.constexpr = O_LAYOUT.instr_shape[1]
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
    # tile 0's softmax masked: a no-op unless it is on the diagonal
    p, alpha, l_i, m_i = _softmax(s, m_i, l_i, 0, q_pos, scale_log2, True, S_LAYOUT)
    p = _a_operand(p, P_LAYOUT, q_smem.dtype)
    first_masked = gl.maximum(n_full, 1)
    for j in range(1, first_masked):
        o, p, m_i, l_i = _step_fa3(q_smem, ring, turns, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col,
                                   scale_log2, False, S_LAYOUT, O_LAYOUT, P_LAYOUT, NUM_BUFFERS, WARP_SPEC, C,
                                   PINGPONG)
    for j in range(first_masked, n_tiles):
        o, p, m_i, l_i = _step_fa3(q_smem, ring, turns, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col,
                                   scale_log2, True, S_LAYOUT, O_LAYOUT, P_LAYOUT, NUM_BUFFERS, WARP_SPEC, C,
                                   PINGPONG)
    _take_turn(turns, n_tiles, C, PINGPONG)
    acc = _issue_pv(p, ring, n_tiles - 1, o, NUM_BUFFERS)
    _pass_turn(turns, C, PINGPONG)
    o, p = warpgroup_mma_wait(0, deps=[acc, p])
    return o, l_i


@gluon.jit
def _attend_ahead(q_smem, ring, s, q_pos, n_full, n_tiles, src, kv_col, scale_log2, S_LAYOUT: gl.constexpr,
                  O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, NUM_BUFFERS: gl.constexpr,
                  WARP_SPEC: gl.constexpr):
    """The key loop with S_{j+1} issued before softmax(S_j), from S_0 (retired): -> (O unnormalized, l)."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = S_LAYOUT.instr_shape[1]
    HEAD_DIM: gl.constexpr = O_LAYOUT.instr_shape[1]
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
    if n_tiles > 1:
        # tile 0 (masked: a no-op unless it is on the diagonal) has no P V before it
        p = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT)
        s, o, p, m_i, l_i = _step_ahead(q_smem, ring, s, o, p, m_i, l_i, 0, n_tiles, q_pos, src, kv_col,
                                        scale_log2, True, False, True, S_LAYOUT, O_LAYOUT, P_LAYOUT, NUM_BUFFERS,
                                        WARP_SPEC)
        for j in range(1, n_full):
            s, o, p, m_i, l_i = _step_ahead(q_smem, ring, s, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col,
                                            scale_log2, False, True, True, S_LAYOUT, O_LAYOUT, P_LAYOUT, NUM_BUFFERS,
                                            WARP_SPEC)
        for j in range(gl.maximum(n_full, 1), n_tiles - 1):
            s, o, p, m_i, l_i = _step_ahead(q_smem, ring, s, o, p, m_i, l_i, j, n_tiles, q_pos, src, kv_col,
                                            scale_log2, True, True, True, S_LAYOUT, O_LAYOUT, P_LAYOUT, NUM_BUFFERS,
                                            WARP_SPEC)
        s, o, p, m_i, l_i = _step_ahead(q_smem, ring, s, o, p, m_i, l_i, n_tiles - 1, n_tiles, q_pos, src,
                                        kv_col, scale_log2, True, True, False, S_LAYOUT, O_LAYOUT, P_LAYOUT,
                                        NUM_BUFFERS, WARP_SPEC)
    else:
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, 0, q_pos, scale_log2, True, S_LAYOUT)
    p = _a_operand(p, P_LAYOUT, q_smem.dtype)
    acc = _issue_pv(p, ring, n_tiles - 1, o, NUM_BUFFERS)
    o, p = warpgroup_mma_wait(0, deps=[acc, p])
    return o, l_i


@gluon.jit
def _consume(q_smem, q_bar, ring, turns, src, out_ptr, h, q_start, q_len, q_first, cached, n_tiles, kv_col,
             scale_log2, stride_ot, stride_oh, S_AHEAD: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
             P_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, NUM_BUFFERS: gl.constexpr, WARP_SPEC: gl.constexpr,
             C: gl.constexpr, PINGPONG: gl.constexpr):
    """The MMA and softmax warps: every key tile of the query tile, then the normalized rows into ``out``. A query
    row's position is ``cached`` (the keys before the chunk) plus its row in the chunk. ``q_smem``/``q_first``:
    this consumer's rows (all the query tile's, or with two consumers its half); every consumer of a query tile
    runs all ``n_tiles`` key tiles (the tile's), so each frees each K/V slot once and takes every turn."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = S_LAYOUT.instr_shape[1]
    HEAD_DIM: gl.constexpr = O_LAYOUT.instr_shape[1]
    n_full = (cached + q_first) // BLOCK_N     # key tiles every row of this consumer sees whole
    q_pos = cached + q_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
    mbarrier.wait(q_bar, 0)
    _take_turn(turns, 0, C, PINGPONG)
    s = _issue_qk(q_smem, ring, 0, S_LAYOUT, NUM_BUFFERS)
    _pass_turn(turns, C, PINGPONG)
    s = warpgroup_mma_wait(0, deps=[s])
    _free_k(ring, 0, src, kv_col, n_tiles, NUM_BUFFERS, WARP_SPEC)
    if S_AHEAD:
        o, l_i = _attend_ahead(q_smem, ring, s, q_pos, n_full, n_tiles, src, kv_col, scale_log2, S_LAYOUT,
                               O_LAYOUT, P_LAYOUT, NUM_BUFFERS, WARP_SPEC)
    else:
        o, l_i = _attend_fa3(q_smem, ring, turns, s, q_pos, n_full, n_tiles, src, kv_col, scale_log2, S_LAYOUT,
                             O_LAYOUT, P_LAYOUT, NUM_BUFFERS, WARP_SPEC, C, PINGPONG)
    # l_i >= 1: the row's maximum contributes exp2(0)
    o = o / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
    out = gl.convert_layout(o.to(q_smem.dtype), OUT_LAYOUT)   # 16-byte stores along D
    offs_m = q_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, OUT_LAYOUT))
    rows = (q_start + offs_m).to(gl.int64)
    gl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out, mask=(offs_m < q_len)[:, None])


@gluon.jit
def _produce(ring, src, kv_col, n_tiles, NUM_BUFFERS: gl.constexpr, PAGES_AT_ONCE: gl.constexpr):
    """The producer warp (WARP_SPEC): refills each ring slot once the consumer has freed it (tiles from
    NUM_BUFFERS on: the first NUM_BUFFERS are issued before the partitions fork). ``PAGES_AT_ONCE`` (paged keys):
    a tile's cache blocks come in one load, issued before the wait for its slot and shared by its K and V copies,
    instead of one dependent table load before each copy (16 a 128-key tile of 16-token blocks)."""
    k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    PIECES: gl.constexpr = k_bufs.shape[1] // k_desc.block_type.shape[0]
    for j in range(NUM_BUFFERS, n_tiles):
        idx = j % NUM_BUFFERS
        freed = (j // NUM_BUFFERS - 1) & 1   # the release of tile j - NUM_BUFFERS completes that phase
        if PAGES_AT_ONCE:
            pages = _tile_pages(src, j, PIECES)
            mbarrier.wait(k_empty.index(idx), freed)
            _load_pages(k_desc, k_bufs, k_ready, j, pages, kv_col, NUM_BUFFERS)
            mbarrier.wait(v_empty.index(idx), freed)
            _load_pages(v_desc, v_bufs, v_ready, j, pages, kv_col, NUM_BUFFERS)
        else:
            mbarrier.wait(k_empty.index(idx), freed)
            _load_tile(k_desc, k_bufs, k_ready, j, src, kv_col, True, NUM_BUFFERS)
            mbarrier.wait(v_empty.index(idx), freed)
            _load_tile(v_desc, v_bufs, v_ready, j, src, kv_col, True, NUM_BUFFERS)


@gluon.jit(do_not_specialize=["batch", "num_tiles", "stride_table"])
def _prefill_gluon_kernel(
    q_desc, k_desc, v_desc, qsl_ptr, work_ptr, out_ptr, table_ptr, seq_lens_ptr,
    scale_log2, batch, num_tiles, stride_ot, stride_oh, stride_table,
    HQ: gl.constexpr, G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_BUFFERS: gl.constexpr, USE_WORK: gl.constexpr, S_AHEAD: gl.constexpr, WARP_SPEC: gl.constexpr,
    PAGED: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, PAGES_AT_ONCE: gl.constexpr,
    S_LAYOUT: gl.constexpr,
    O_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr,
):
    """One (prompt, query tile) pair for one query head. ``PAGED``: every key of the sequence (its cached prefix and
    the chunk's own, written there before) from the paged cache, by k/v descriptors over it with one-page boxes
    (``table_ptr``: the block tables, ``seq_lens_ptr``: the sequences' lengths); otherwise a fresh prompt's keys
    from the step's k/v (``table_ptr``/``seq_lens_ptr`` unused). ``CONSUMERS`` 2 (with ``WARP_SPEC``): the
    kernel's warps (one warpgroup) attend for the query tile's first half of the rows, a worker partition of four
    warps for the second half (the layouts are one warpgroup's), each waiting and freeing on its own; with
    ``PINGPONG`` they issue their MMAs in turns (`_take_turn`)."""
    pid = gl.program_id(0)
    h = pid % HQ          # query head fastest: programs sharing K/V tiles run together (L2)
    w = pid // HQ
    if USE_WORK:          # (prompt, query tile), heaviest first
        b = gl.load(work_ptr + 2 * w)
        tile = gl.load(work_ptr + 2 * w + 1)
    else:                 # every (tile, prompt) pair, the last (longest) query tiles first
        b = w % batch
        tile = num_tiles - 1 - w // batch
    q_start = gl.load(qsl_ptr + b)
    q_len = gl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    q_first = tile * BLOCK_M
    if PAGED:
        seq_len = gl.load(seq_lens_ptr + b)
        cached = seq_len - q_len                   # keys before the chunk
        PAGE: gl.constexpr = k_desc.block_type.shape[0]
        src = (0, table_ptr + b.to(gl.int64) * stride_table, gl.cdiv(seq_len, PAGE))
    else:
        cached = 0
        src = (q_start, table_ptr, 0)
    end_n = cached + gl.minimum(q_len, q_first + BLOCK_M)   # one past the tile's last key
    n_tiles = gl.cdiv(end_n, BLOCK_N)
    kv_col = (h // G) * HEAD_DIM
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    # the rings hold whole key tiles (a paged descriptor's box is one page: same NVMMA layout, fewer rows)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)   # a slot is free once every consumer is done with it
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    fence_async_shared()   # the barriers' initialization before the TMA unit signals them

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_start + q_first, h * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(NUM_BUFFERS):
        _load_tile(k_desc, k_bufs, k_ready, i, src, kv_col, i < n_tiles, NUM_BUFFERS)
        _load_tile(v_desc, v_bufs, v_ready, i, src, kv_col, i < n_tiles, NUM_BUFFERS)
    ring = (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty)
    if CONSUMERS == 2:
        # a warpgroup for each half of the query rows (the default partition and a worker of four warps, 240
        # registers each), one producer warp (24) issuing the refills
        HALF: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_consume, (q_smem.slice(0, HALF), q_bar, ring, turns, src, out_ptr, h, q_start, q_len, q_first, cached,
                        n_tiles, kv_col, scale_log2, stride_ot, stride_oh, S_AHEAD, S_LAYOUT, O_LAYOUT, P_LAYOUT,
                        OUT_LAYOUT, NUM_BUFFERS, True, 0, PINGPONG)),
            (_consume, (q_smem.slice(HALF, HALF), q_bar, ring, turns, src, out_ptr, h, q_start, q_len,
                        q_first + HALF, cached, n_tiles, kv_col, scale_log2, stride_ot, stride_oh, S_AHEAD, S_LAYOUT,
                        O_LAYOUT, P_LAYOUT, OUT_LAYOUT, NUM_BUFFERS, True, 1, PINGPONG)),
            (_produce, (ring, src, kv_col, n_tiles, NUM_BUFFERS, PAGES_AT_ONCE)),
        ], [4, 1], [240, 24])
    elif WARP_SPEC:
        # one producer warp (24 registers) issues the refills; the kernel's warps (the default partition) consume
        gl.warp_specialize([
            (_consume, (q_smem, q_bar, ring, turns, src, out_ptr, h, q_start, q_len, q_first, cached, n_tiles,
                        kv_col, scale_log2, stride_ot, stride_oh, S_AHEAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, OUT_LAYOUT,
                        NUM_BUFFERS, True, 0, False)),
            (_produce, (ring, src, kv_col, n_tiles, NUM_BUFFERS, PAGES_AT_ONCE)),
        ], [1], [24])
    else:
        _consume(q_smem, q_bar, ring, turns, src, out_ptr, h, q_start, q_len, q_first, cached, n_tiles, kv_col,
                 scale_log2, stride_ot, stride_oh, S_AHEAD, S_LAYOUT, O_LAYOUT, P_LAYOUT, OUT_LAYOUT, NUM_BUFFERS,
                 False, 0, False)


# ---------------------------------------------------------------------------------------------------------- host

@functools.cache
def kernel_layouts(block_m: int, block_n: int, head_dim: int, num_warps: int) -> dict[str, object]:
    """The kernel's register layouts (its constexpr arguments): the S and O wgmma accumulators (warps stacked
    along M: one warpgroup per 64 rows), P as O's A operand, and the output tile for 16-byte stores."""
    s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])
    o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, head_dim, 16])
    lanes_d = head_dim // 8
    out_layout = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes_d, lanes_d],
                                  warps_per_cta=[num_warps, 1], order=[1, 0])
    return {"S_LAYOUT": s_layout, "O_LAYOUT": o_layout,
            "P_LAYOUT": gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2), "OUT_LAYOUT": out_layout}


def smem_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The NVMMA-swizzled shared layout of a ``[rows, head_dim]`` TMA box (Q's, K's and V's)."""
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def shared_bytes(block_m: int, block_n: int, head_dim: int, num_buffers: int, warp_specialize: bool = False,
                 elem_bytes: int = 2) -> int:
    """Shared memory of the buffers: Q's tile and the two K/V rings, and with warp specialization the output
    tile's layout conversion (which otherwise reuses the rings, dead by then). The mbarriers come on top (a few
    dozen bytes): the compiled kernel's ``metadata.shared`` is the real figure."""
    out_scratch = block_m * head_dim * elem_bytes if warp_specialize else 0
    return (block_m + 2 * num_buffers * block_n) * head_dim * elem_bytes + out_scratch


def default_block_n(s_ahead: bool) -> int:
    """Keys a tile: 128 (FlashAttention-3's for D 128), 64 with ``s_ahead`` (two score tiles live: at 128 it
    spills on sm_90)."""
    return 64 if s_ahead else 128


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def check_tile(block_m: int, block_n: int, num_buffers: int, num_warps: int, head_dim: int,
               warp_specialize: bool = False, consumers: int = 1, pingpong: bool = False,
               s_ahead: bool = False, pages_at_once: bool = False) -> None:
    """ValueError naming the tile argument the kernel does not support."""
    if consumers not in (1, 2):
        fail("consumers", f"must be 1 or 2, got {consumers}")
    if consumers == 2 and not (warp_specialize and num_warps == 8 and block_m == 128):
        fail("consumers", "2 consumer warpgroups need warp_specialize, num_warps 8 and block_m 128 (64 rows each)")
    if pingpong and (consumers != 2 or s_ahead):
        fail("pingpong", "the MMAs in turns need 2 consumers in FlashAttention-3's order (s_ahead off)")
    if pages_at_once and not warp_specialize:
        fail("pages_at_once", "a tile's cache blocks in one load are the producer warp's: needs warp_specialize")
    if num_warps not in (4, 8):
        fail("num_warps", f"must be 4 or 8 (one or two warpgroups), got {num_warps}")
    if block_m not in (64, 128) or block_m < 16 * num_warps:
        fail("block_m", f"must be 64 or 128 and at least 16 rows a warp ({16 * num_warps}), got {block_m}")
    if block_n not in (32, 64, 128):
        fail("block_n", f"must be 32, 64 or 128, got {block_n}")
    if not (1 <= num_buffers <= 4):
        fail("num_buffers", f"must be in 1..4, got {num_buffers}")
    if shared_bytes(block_m, block_n, head_dim, num_buffers, warp_specialize) > HOPPER_MAX_SHARED:
        fail("num_buffers", f"{num_buffers} K/V buffers of {block_n} x {head_dim} with a {block_m}-row Q tile"
                            f"{' (warp-specialized)' if warp_specialize else ''} need more than {HOPPER_MAX_SHARED} "
                            "bytes of shared memory")


@dataclasses.dataclass(frozen=True)
class GluonTile:
    """The kernel's tiling arguments (`prefill_attention_gluon`)."""

    block_m: int = 128
    block_n: int = 128
    num_buffers: int = 2
    num_warps: int = 8
    s_ahead: bool = False
    warp_specialize: bool = False
    consumers: int = 1
    pingpong: bool = False
    pages_at_once: bool = False   # paged keys: a tile's cache blocks in one load by the producer warp


# The variants' names in the benchmarks (`named_tile`): the key loop's order, then how the warps share the work.
SCHEDULE_NAMES = ("fa3", "ahead", "fa3-ws", "ahead-ws", "fa3-ws2", "ahead-ws2", "fa3-pp")


def named_tile(schedule: str, block_m: int = 128, block_n: int | None = None, num_buffers: int = 2,
               num_warps: int = 8) -> GluonTile:
    """A `SCHEDULE_NAMES` variant as a tile: "fa3" or "ahead" (``s_ahead``), alone (the warps in step), "-ws" (a
    producer warp), "-ws2" (that and two consumer warpgroups) or "-pp" (two consumers taking turns)."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULE_NAMES)}, got {schedule!r}")
    order, _, sharing = schedule.partition("-")
    s_ahead = order == "ahead"
    return GluonTile(block_m=block_m, block_n=default_block_n(s_ahead) if block_n is None else block_n,
                     num_buffers=num_buffers, num_warps=num_warps, s_ahead=s_ahead, warp_specialize=bool(sharing),
                     consumers=2 if sharing in ("ws2", "pp") else 1, pingpong=sharing == "pp")


# KVFLEET_GLUON_SCHEDULE=fa3: FlashAttention-3's order at 128 x 128 with two buffers, the eight warps in step: the
# H200's best at 1 x 8192 in lease 12 (509 TFLOP/s against v2's 459; warp-specialized 503) and 379 at 2 x 4096 (v2
# 342, warp-specialized 398). On chunks over a cached prefix the same tile with a producer warp issuing the K/V
# copies, eight a tile from 16-token blocks, and their block-table loads (single-partition, sm_90 puts ~18 CTA
# barriers an iteration around them: `bench/gluon_attention_resources.py`).
FA3_TILE = GluonTile()
FA3_CHUNK_TILE = GluonTile(warp_specialize=True)
# The default (KVFLEET_GLUON_SCHEDULE=two-warpgroups): a producer warp and the two warpgroups as two consumer
# partitions of 64 query rows each, waiting and freeing on their own. On an H100 (issue 16, lease 19) 588 TFLOP/s at
# 1 x 8192 against fa3's 506, 488 against 424 at 2 x 4096, 240 against 225 at 8 x 1024; paged, 488 against 433 on a
# 2k chunk over 6k cached keys and 410 against 391 on 16 x 384 over a 2k prefix; end to end long prompts 602-604
# against 593-594 output tok/s in three pairs. "pingpong" issues the two consumers' MMAs in turns (FlashAttention-3's
# ping-pong): 534 / 475 fresh, 486 / 432 paged, level with two-warpgroups end to end.
TWO_WARPGROUPS_TILE = GluonTile(warp_specialize=True, consumers=2)
PINGPONG_TILE = GluonTile(warp_specialize=True, consumers=2, pingpong=True)
GLUON_SCHEDULES = ("two-warpgroups", "pingpong", "fa3")


def engine_tiles(schedule: str, pages_at_once: bool = False) -> tuple[GluonTile, GluonTile]:
    """The tiles the engine runs on fresh prompts and on chunks over a cached prefix for a ``GLUON_SCHEDULES``
    choice: "fa3" (`FA3_TILE`, `FA3_CHUNK_TILE`), "two-warpgroups" or "pingpong" (that tile for both);
    ``pages_at_once``: the chunk tile's producer loads a tile's block numbers at once (every chunk tile has one)."""
    if schedule == "fa3":
        fresh, chunk = FA3_TILE, FA3_CHUNK_TILE
    elif schedule == "pingpong":
        fresh, chunk = PINGPONG_TILE, PINGPONG_TILE
    elif schedule == "two-warpgroups":
        fresh, chunk = TWO_WARPGROUPS_TILE, TWO_WARPGROUPS_TILE
    else:
        raise ValueError(f"expected one of {', '.join(GLUON_SCHEDULES)}, got {schedule!r}")
    return fresh, dataclasses.replace(chunk, pages_at_once=pages_at_once)


def gluon_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `prefill_attention_gluon` takes these ``[T, H, D]`` tensors (the engine's choice, once a step): the
    kernel's own checks of them (`_check_qkv`: a Hopper GPU, bf16/fp16 everywhere, head dim 64 or 128, whole GQA
    groups, rows a 2-D descriptor can read), as a yes or no."""
    try:
        _check_qkv(q, k, v)
    except ValueError:
        return False
    return True


def _check_tma_rows(name: str, t: torch.Tensor) -> None:
    """A ``[T, H, D]`` tensor a 2-D descriptor can read as ``[T, H * D]``: heads packed, rows 16-byte aligned."""
    d, es = t.shape[2], t.element_size()
    if not (t.stride(2) == 1 and t.stride(1) == d):
        fail(name, f"needs strides (*, {d}, 1) (heads packed in a row), got {t.stride()}")
    if (t.stride(0) * es) % 16 != 0 or t.data_ptr() % 16 != 0:
        fail(name, f"rows must be 16-byte aligned (stride {t.stride(0)}, address {t.data_ptr():#x})")


def _check_q(q: torch.Tensor) -> tuple[int, int, int]:
    """q as either form of the kernel reads it (16-bit, a head dim it has, rows a descriptor reads) -> (T, Hq, D)."""
    check_tensor("q", q, ndim=3, dtype=GLUON_DTYPES)
    t, hq, d = q.shape
    if d not in HEAD_DIMS:
        fail("q", f"head dim {d} not in {HEAD_DIMS}")
    _check_tma_rows("q", q)
    return t, hq, d


def _check_device(q: torch.Tensor) -> None:
    """A device the kernel runs on: a Hopper GPU (no interpreter, wgmma)."""
    if q.device.type != "cuda":
        fail("q", f"on {q.device}: the Gluon kernel runs on a CUDA device only (no interpreter)")
    if not _hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        fail("q", "the Gluon kernel needs a Hopper GPU (compute capability 9.x: wgmma)")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """q/k/v as the kernel reads them, on a device it runs on -> (T, Hq, Hkv, D)."""
    t, hq, d = _check_q(q)
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x, ndim=3, dtype=q.dtype, device=q.device)
        if not (x.shape[0] == t and x.shape[2] == d and x.shape == k.shape):
            fail(name, f"expected shape ({t}, Hkv, {d}) like k's {tuple(k.shape)}, got {tuple(x.shape)}")
    hkv = k.shape[1]
    if hq % hkv != 0:
        fail("q", f"{hq} query heads not a multiple of {hkv} KV heads")
    for name, x in (("k", k), ("v", v)):
        _check_tma_rows(name, x)
    _check_device(q)
    return t, hq, hkv, d


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                out: torch.Tensor) -> tuple[int, int, int, int]:
    """-> (T, Hq, Hkv, D)."""
    dims = _check_qkv(q, k, v)
    check_tensor("out", out, ndim=3, dtype=q.dtype, device=q.device)
    if out.shape != q.shape:
        fail("out", f"shape {tuple(out.shape)} != q {tuple(q.shape)}")
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtype=torch.int32, device=q.device)
    if query_start_loc.shape[0] < 1:
        fail("query_start_loc", "must hold at least one offset (B + 1)")
    return dims


def prefill_attention_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    work: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int | None = None,
    num_buffers: int = 2,
    num_warps: int = 8,
    s_ahead: bool = False,
    warp_specialize: bool = False,
    consumers: int = 1,
    pingpong: bool = False,
    pages_at_once: bool = False,
) -> torch.Tensor:
    """Causal attention of fresh prompts into ``out`` ``[T, Hq, D]``: prompt b's rows ``query_start_loc[b] ..
    query_start_loc[b + 1]`` of ``q`` ``[T, Hq, D]`` attend to the same rows of ``k``/``v`` ``[T, Hkv, D]`` (no
    cached prefix). ``k``/``v`` may be views of a fused qkv projection (``stride(1) == D``, unit last stride,
    16-byte aligned rows; q likewise). ``work``: optional ``prefill_work(qsl, block_m, False, device, seq_lens)``
    list (heaviest first); without it the grid covers every (tile, prompt) pair, the last tiles first.
    ``s_ahead``: the schedule issuing tile j+1's ``Q K^T`` before tile j's softmax (module docstring);
    ``block_n`` None: 128 keys a tile, 64 with ``s_ahead``. ``warp_specialize``: a producer warp issues the K/V
    refills (``gl.warp_specialize``), the ``num_warps`` warps only wait for tiles and compute. ``consumers`` 2:
    those warps as two partitions of a warpgroup, 64 query rows each; ``pingpong``: issuing their MMAs in turns.
    ``pages_at_once``: the paged form's only (a `GluonTile` field): a ValueError here."""
    if pages_at_once:
        fail("pages_at_once", "fresh prompts' keys come from k/v, not from cache blocks")
    t, hq, hkv, d = _check_args(q, k, v, query_start_loc, out)
    block_n = default_block_n(s_ahead) if block_n is None else block_n
    check_tile(block_m, block_n, num_buffers, num_warps, d, warp_specialize, consumers, pingpong, s_ahead)
    if not (max_query_len >= 0):
        fail("max_query_len", "must be >= 0")
    batch = query_start_loc.shape[0] - 1
    if t == 0 or batch == 0 or max_query_len == 0:
        return out
    num_tiles = triton.cdiv(max_query_len, block_m)
    if work is not None:
        if check_prefill_work(work, q.device) == 0:
            return out
        programs = work.shape[0] * hq
    else:
        programs = num_tiles * batch * hq
    q_desc = TensorDescriptor(q, [t, hq * d], [q.stride(0), 1], [block_m, d], smem_layout(block_m, d, q.dtype))
    kv_layout = smem_layout(block_n, d, q.dtype)
    k_desc, v_desc = (TensorDescriptor(x, [t, hkv * d], [x.stride(0), 1], [block_n, d], kv_layout) for x in (k, v))
    _prefill_gluon_kernel[(programs,)](
        q_desc, k_desc, v_desc, query_start_loc, work if work is not None else query_start_loc, out,
        query_start_loc, query_start_loc,   # no block tables, no sequence lengths: fresh prompts
        scale * LOG2E, batch, num_tiles, out.stride(0), out.stride(1), 0,
        HQ=hq, G=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUFFERS=num_buffers,
        USE_WORK=work is not None, S_AHEAD=s_ahead, WARP_SPEC=warp_specialize, PAGED=False, CONSUMERS=consumers,
        PINGPONG=pingpong, PAGES_AT_ONCE=False,
        **kernel_layouts(block_m // consumers, block_n, d, num_warps // consumers),
        num_warps=num_warps // consumers,
    )
    return out


def paged_applies(kv_cache: torch.Tensor, block_n: int) -> bool:
    """Whether `prefill_attention_gluon_paged` reads this cache ``[2, blocks, block_size, Hkv, D]`` with key tiles
    of ``block_n`` rows (the cache's own checks, `_check_cache`, as a yes or no)."""
    try:
        _check_cache(kv_cache, block_n)
    except ValueError:
        return False
    return True


def _check_cache(kv_cache: torch.Tensor, block_n: int) -> tuple[int, int, int]:
    """The paged cache as the kernel reads it: each half ``[blocks * block_size, Hkv * D]`` rows of 2-D
    descriptors with one-block boxes, several blocks a key tile -> (blocks, block_size, Hkv)."""
    check_tensor("kv_cache", kv_cache, ndim=5, dtype=GLUON_DTYPES)
    _, nb, bs, hkv, d = kv_cache.shape
    if bs >= block_n or block_n % bs != 0 or bs % 8 != 0:
        fail("kv_cache", f"blocks of {bs} tokens: the kernel needs blocks of a multiple of 8 tokens that divide its "
                         f"{block_n}-key tiles, and shorter than them")
    es = kv_cache.element_size()
    s_kv, s_blk, s_slot, s_head, s_d = kv_cache.stride()
    if not (s_d == 1 and s_head == d and s_slot == hkv * d and s_blk == bs * s_slot):
        fail("kv_cache", f"needs a contiguous [2, blocks, block_size, Hkv, D] layout, got strides {kv_cache.stride()}")
    if (s_slot * es) % 16 != 0 or (s_kv * es) % 16 != 0 or kv_cache.data_ptr() % 16 != 0:
        fail("kv_cache", "rows must be 16-byte aligned")
    return nb, bs, hkv


def prefill_attention_gluon_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    work: torch.Tensor,
    block_m: int = 128,
    block_n: int = 128,
    num_buffers: int = 2,
    num_warps: int = 8,
    s_ahead: bool = False,
    warp_specialize: bool = False,
    consumers: int = 1,
    pingpong: bool = False,
    pages_at_once: bool = False,
) -> torch.Tensor:
    """Causal attention of chunks over a cached prefix into ``out`` ``[T, Hq, D]``: sequence b's query rows
    ``query_start_loc[b] .. query_start_loc[b + 1]`` of ``q`` (its last tokens: positions ``seq_lens[b] - q_len``
    on) attend to its first ``seq_lens[b]`` keys, all read from the paged cache ``[2, blocks, block_size, Hkv, D]``
    through ``block_tables`` ``[B, max_blocks]`` (the chunk's own keys written there first, rotated). One copy a
    cache block into the key tile's rows: blocks of 16 tokens, 8 copies a 128-key tile, and a block-table load
    for each (``warp_specialize``: a producer warp issues them, off the softmax warps' path). ``work``: the
    (sequence, query tile) pairs to attend for, `prefill_work(qsl, block_m, False, device, seq_lens, only=...)`;
    the others' rows are not written. ``consumers``/``pingpong``: as `prefill_attention_gluon`'s.
    ``pages_at_once`` (with ``warp_specialize``): the producer warp loads a tile's block numbers in one load before
    waiting for its slot, and its K and V copies share them."""
    bs, hkv, d, hq, batch = check_paged_attention_args(q, out, kv_cache, block_tables, seq_lens, query_start_loc)
    t = _check_q(q)[0]
    _check_device(q)
    nb = _check_cache(kv_cache, block_n)[0]
    if block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        fail("block_tables", f"expected [{batch}, max_blocks] rows of unit stride, got {tuple(block_tables.shape)} "
                             f"strides {block_tables.stride()}")
    check_tile(block_m, block_n, num_buffers, num_warps, d, warp_specialize, consumers, pingpong, s_ahead,
               pages_at_once)
    if t == 0 or batch == 0 or max_query_len == 0 or check_prefill_work(work, q.device) == 0:
        return out
    q_desc = TensorDescriptor(q, [t, hq * d], [q.stride(0), 1], [block_m, d], smem_layout(block_m, d, q.dtype))
    page_layout = smem_layout(bs, d, q.dtype)
    if page_layout != smem_layout(block_n, d, q.dtype):
        fail("kv_cache", f"blocks of {bs} tokens take another shared-memory layout than {block_n}-key tiles")
    k_desc, v_desc = (TensorDescriptor(kv_cache[i], [nb * bs, hkv * d], [kv_cache.stride(2), 1], [bs, d], page_layout)
                      for i in (0, 1))
    _prefill_gluon_kernel[(work.shape[0] * hq,)](
        q_desc, k_desc, v_desc, query_start_loc, work, out, block_tables, seq_lens,
        scale * LOG2E, batch, triton.cdiv(max_query_len, block_m), out.stride(0), out.stride(1),
        block_tables.stride(0),
        HQ=hq, G=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUFFERS=num_buffers,
        USE_WORK=True, S_AHEAD=s_ahead, WARP_SPEC=warp_specialize, PAGED=True, CONSUMERS=consumers,
        PINGPONG=pingpong, PAGES_AT_ONCE=pages_at_once,
        **kernel_layouts(block_m // consumers, block_n, d, num_warps // consumers),
        num_warps=num_warps // consumers,
    )
    return out
