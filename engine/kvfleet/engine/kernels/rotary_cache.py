"""Rotary embedding of q and k fused with the write of k and v into the paged KV cache.

One program per token: it rotates the token's query heads in place, rotates its
key heads and stores them, with its value heads, at the token's cache slot
(``rotary.apply_rotary_cos_sin`` followed by ``reshape_and_cache``, in one launch
instead of two; the rotated keys are only needed in the cache, so ``k`` itself is
left as it was, unless ``rotate_k`` asks to rotate it in place as well: the v2
prefill kernel reads a fresh prompt's keys from ``k``). ``cos``/``sin`` are per
token ``[T, D]`` in Hugging Face's layout (both halves equal) or ``[T, D/2]``; the
rotation is done in float32 and rounded to the input dtype before it is cast to the
cache's, as the two kernels do. A slot of -1 writes nothing (padding rows of a
CUDA-graph batch); the query is rotated anyway.

Given norm weights (Qwen3's q_norm/k_norm), every query and key head is RMS-normalised
before it is rotated, with ``rms_norm``'s numerics: the norm costs no launch and no copy
of the strided q/k views of its own (as two ``rms_norm`` calls did: one program of one
warp per 128-wide head, after a copy each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, next_pow2
from .reshape_and_cache import reshape_and_cache_ref
from .rms_norm import rms_norm_ref
from .rotary import check_qk, rotate_halves


@triton.jit
def _store_kv(cache_ptr, slot, k1, k2, v_ptr, t, hk, j, kmask, stride_vt, stride_vh,
              stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
              HK: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_SIZE: tl.constexpr):
    """The token's rotated key halves and its value heads, at its cache slot."""
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
    kdst = dst + hk[:, None] * stride_c_head + j[None, :]
    ty = cache_ptr.dtype.element_ty
    tl.store(kdst, k1.to(ty), mask=kmask)
    tl.store(kdst + HALF, k2.to(ty), mask=kmask)
    d = tl.arange(0, D_PAD)
    vmask = (hk[:, None] < HK) & (d[None, :] < HEAD_DIM)
    v = tl.load(v_ptr + t * stride_vt + hk[:, None] * stride_vh + d[None, :], mask=vmask)
    tl.store(dst + stride_c_kv + hk[:, None] * stride_c_head + d[None, :], v.to(ty), mask=vmask)


@triton.jit
def _rms_normed_halves(x1, x2, w_ptr, j, jmask, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Each head ``[x1 | x2]`` (a row of the tiles) under RMSNorm, in ``rms_norm``'s steps: float32 mean of squares,
    the normalised value rounded to the dtype, times the weight, rounded again."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    n1 = (a * inv).to(x1.dtype).to(tl.float32) * w1
    n2 = (b * inv).to(x1.dtype).to(tl.float32) * w2
    return n1.to(x1.dtype), n2.to(x1.dtype)


@triton.jit
def _rotated_heads(p, mask, cos, sin, w_ptr, j, jmask, eps,
                   HALF: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """The heads at ``p`` (normalised first with ``NORM``), rotated: their two halves in their dtype."""
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    if NORM:
        x1, x2 = _rms_normed_halves(x1, x2, w_ptr, j, jmask, eps, HALF, HEAD_DIM)
    return rotate_halves(x1, x2, cos, sin)


@triton.jit
def _rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, qw_ptr, kw_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROTATE_K: tl.constexpr, NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jmask = j < HALF
    cos = tl.load(cos_ptr + t * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_sin + j, mask=jmask, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, HQ_PAD)
    qmask = (hq[:, None] < HQ) & jmask[None, :]
    qp = q_ptr + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    q1, q2 = _rotated_heads(qp, qmask, cos, sin, qw_ptr, j, jmask, eps, HALF, HEAD_DIM, NORM)
    tl.store(qp, q1, mask=qmask)
    tl.store(qp + HALF, q2, mask=qmask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = tl.arange(0, HK_PAD)
    kmask = (hk[:, None] < HK) & jmask[None, :]
    kp = k_ptr + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
    if ROTATE_K:   # k rotated in place too (every row, as q), for a reader of the step's keys besides the cache
        r1, r2 = _rotated_heads(kp, kmask, cos, sin, kw_ptr, j, jmask, eps, HALF, HEAD_DIM, NORM)
        tl.store(kp, r1, mask=kmask)
        tl.store(kp + HALF, r2, mask=kmask)
        if slot >= 0:
            _store_kv(cache_ptr, slot, r1, r2, v_ptr, t, hk, j, kmask, stride_vt, stride_vh,
                      stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head, HK, HALF, HEAD_DIM, D_PAD, BLOCK_SIZE)
    else:
        if slot >= 0:
            r1, r2 = _rotated_heads(kp, kmask, cos, sin, kw_ptr, j, jmask, eps, HALF, HEAD_DIM, NORM)
            _store_kv(cache_ptr, slot, r1, r2, v_ptr, t, hk, j, kmask, stride_vt, stride_vh, stride_c_kv,
                      stride_c_blk, stride_c_slot, stride_c_head, HK, HALF, HEAD_DIM, D_PAD, BLOCK_SIZE)


def rotary_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, rotate_k: bool = False,
                     q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                     norm_eps: float = 1e-6) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` in place; store rotated ``k`` and ``v`` ``[T, Hkv, D]`` at ``slot_mapping``
    in ``kv_cache`` ``[2, blocks, block_size, Hkv, D]``. ``k`` is not modified unless ``rotate_k``: then it is
    rotated in place too (for the prefill kernel that reads a fresh prompt's keys from ``k``). With
    ``q_norm_weight`` and ``k_norm_weight`` ``[D]`` (both or neither) each head is RMS-normalised (``norm_eps``)
    before it is rotated, wherever the rotated values go."""
    check_qk(q, k)
    norm = q_norm_weight is not None or k_norm_weight is not None
    if norm:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            if w is None:
                fail(name, "missing: give both norm weights or neither")
            check_tensor(name, w, ndim=1, device=q.device)
            if not (w.shape[0] == q.shape[2]):
                fail(name, f"size {w.shape[0]} != head_dim {q.shape[2]}")
        if not (norm_eps > 0):
            fail("norm_eps", f"must be > 0, got {norm_eps}")
    check_tensor("v", v, ndim=3, dtype=q.dtype, device=q.device)
    check_tensor("kv_cache", kv_cache, ndim=5, dtype=SUPPORTED_DTYPES, device=q.device)
    t, hq, d = q.shape
    hk = k.shape[1]
    if not (kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (hk, d)):
        fail("kv_cache", f"shape {tuple(kv_cache.shape)} does not match (2, blocks, block_size, {hk}, {d})")
    if not (v.shape == k.shape):
        fail("v", f"shape {tuple(v.shape)} != k {tuple(k.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        check_tensor(name, x, ndim=2, device=q.device)
        if not (x.shape[0] == t and x.shape[1] in (d, d // 2)):
            fail(name, f"shape {tuple(x.shape)} != ({t}, {d})")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtype=(torch.int64, torch.int32), device=q.device)
    if not (slot_mapping.shape[0] == t):
        fail("slot_mapping", f"length {slot_mapping.shape[0]} != tokens {t}")
    if t == 0:
        return
    half = d // 2
    _rotary_cache_kernel[(t,)](
        q, k, v, cos, sin, kv_cache, slot_mapping,
        q_norm_weight if q_norm_weight is not None else q, k_norm_weight if k_norm_weight is not None else k,
        float(norm_eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HQ=hq, HK=hk, HQ_PAD=next_pow2(hq), HK_PAD=next_pow2(hk), HALF=half, HALF_PAD=next_pow2(half),
        HEAD_DIM=d, D_PAD=next_pow2(d), BLOCK_SIZE=kv_cache.shape[2], ROTATE_K=rotate_k, NORM=norm, num_warps=4,
    )


def rotary_and_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                         norm_eps: float = 1e-6) -> torch.Tensor:
    """Plain-PyTorch reference: returns the rotated q and writes the cache (float32 math); the heads normalised
    first (``rms_norm_ref``) when given norm weights."""
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, norm_eps)[0], rms_norm_ref(k, k_norm_weight, norm_eps)[0]
    half = q.shape[-1] // 2
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()

    def rot(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1).to(x.dtype)

    reshape_and_cache_ref(rot(k).to(kv_cache.dtype), v.to(kv_cache.dtype), kv_cache, slot_mapping)
    return rot(q)
