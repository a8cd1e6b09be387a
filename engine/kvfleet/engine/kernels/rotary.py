"""Rotary position embedding (Neox / "rotate half" layout).

``cos_sin_cache[pos] = [cos(pos * inv_freq), sin(pos * inv_freq)]`` (float32,
``[max_pos, head_dim]``); the kernel rotates ``q`` and ``k`` in place, in
float32, for every head of every token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, interpret_mode, next_pow2

if not interpret_mode():   # the interpreter has no libdevice: it takes tl.cos/tl.sin (numpy's) instead
    from triton.language.extra import libdevice


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device | str = "cpu",
                        attention_scaling: float = 1.0) -> torch.Tensor:
    """``[max_positions, 2 * len(inv_freq)]`` float32: cos half then sin half."""
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq.float())
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling).to(device)


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in float32, rounded to the halves' dtype."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def rotated(p, mask, cos, sin, HALF: tl.constexpr):
    """The rotated halves of the heads ``[x1 | x2]`` at ``p``, in their dtype."""
    x1 = tl.load(p, mask=mask, other=0.0)
    x2 = tl.load(p + HALF, mask=mask, other=0.0)
    return rotate_halves(x1, x2, cos, sin)


@triton.jit
def rotate_in_place(p, mask, cos, sin, HALF: tl.constexpr):
    """`rotated`, stored back at ``p``; returns the halves too."""
    r1, r2 = rotated(p, mask, cos, sin, HALF)
    tl.store(p, r1, mask=mask)
    tl.store(p + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    HQ: tl.constexpr, HK: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    USE_POSITIONS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if USE_POSITIONS:
        r = tl.load(pos_ptr + t).to(tl.int64)
    else:
        r = t
    j = tl.arange(0, HALF_PAD)
    jmask = j < HALF
    cos = tl.load(cos_ptr + r * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + r * stride_sin + j, mask=jmask, other=0.0).to(tl.float32)[None, :]
    h = tl.arange(0, H_PAD)

    qmask = (h[:, None] < HQ) & jmask[None, :]
    rotate_in_place(q_ptr + t * stride_qt + h[:, None] * stride_qh + j[None, :], qmask, cos, sin, HALF)
    kmask = (h[:, None] < HK) & jmask[None, :]
    rotate_in_place(k_ptr + t * stride_kt + h[:, None] * stride_kh + j[None, :], kmask, cos, sin, HALF)


def check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    check_tensor("q", q, ndim=3, dtype=SUPPORTED_DTYPES)
    check_tensor("k", k, ndim=3, dtype=q.dtype, device=q.device)
    if not (k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2]):
        fail("k", f"shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if not (q.shape[2] % 2 == 0):
        fail("q", f"head_dim {q.shape[2]} must be even")


def _launch(positions: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, hq, d = q.shape
    if t == 0:
        return
    hk = k.shape[1]
    half = d // 2
    _rotary_kernel[(t,)](
        positions if positions is not None else q, q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        HQ=hq, HK=hk, H_PAD=next_pow2(max(hq, hk)), HALF=half, HALF_PAD=next_pow2(half),
        USE_POSITIONS=positions is not None, num_warps=4,
    )


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` in place by their ``positions``."""
    check_qk(q, k)
    check_tensor("positions", positions, ndim=1, dtype=(torch.int64, torch.int32), device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtype=torch.float32, device=q.device)
    d = q.shape[2]
    if not (positions.shape[0] == q.shape[0]):
        fail("positions", f"length {positions.shape[0]} != tokens {q.shape[0]}")
    if not (cos_sin_cache.shape[1] == d):
        fail("cos_sin_cache", f"width {cos_sin_cache.shape[1]} != head_dim {d}")
    _launch(positions, q, k, cos_sin_cache, cos_sin_cache[:, d // 2:])


def apply_rotary_cos_sin(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate in place with per-token ``cos``/``sin`` ``[T, D]`` in Hugging Face's layout
    (both halves equal, as ``cat(freqs, freqs).cos()``), any float dtype."""
    check_qk(q, k)
    t, _, d = q.shape
    for name, x in (("cos", cos), ("sin", sin)):
        check_tensor(name, x, ndim=2, device=q.device)
        if not (x.shape[0] == t and x.shape[1] in (d, d // 2)):
            fail(name, f"shape {tuple(x.shape)} != ({t}, {d})")
    _launch(None, q, k, cos, sin)


def rotary_embedding_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference (float32 math); returns rotated copies."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :half].float(), x[..., half:].float()
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


@triton.jit
def _rope_tables_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    mask = j < HALF
    freqs = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=mask, other=0.0)
    if LIBDEVICE:   # CUDA's cosf/sinf, as torch's cos/sin on the GPU (tl.cos may lower to an approximation)
        c = libdevice.cos(freqs)
        s = libdevice.sin(freqs)
    else:
        c = tl.cos(freqs)
        s = tl.sin(freqs)
    c = c.to(cos_ptr.dtype.element_ty)
    s = s.to(sin_ptr.dtype.element_ty)
    tl.store(cos_ptr + t * stride_cos + j, c, mask=mask)
    tl.store(cos_ptr + t * stride_cos + HALF + j, c, mask=mask)
    tl.store(sin_ptr + t * stride_sin + j, s, mask=mask)
    tl.store(sin_ptr + t * stride_sin + HALF + j, s, mask=mask)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, 2 * len(inv_freq)]`` in ``dtype`` for ``positions`` ``[T]``, as transformers computes them
    (float32 ``position * inv_freq``, float32 cos/sin, cast to ``dtype``; both halves equal): one launch
    instead of the seven small torch ops of `RotaryEmbedding`."""
    check_tensor("positions", positions, ndim=1, dtype=(torch.int64, torch.int32))
    check_tensor("inv_freq", inv_freq, ndim=1, dtype=torch.float32, device=positions.device)
    t, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((t, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t > 0:
        _rope_tables_kernel[(t,)](positions, inv_freq, cos, sin, cos.stride(0), sin.stride(0),
                                  HALF=half, HALF_PAD=next_pow2(half), LIBDEVICE=not interpret_mode(), num_warps=1)
    return cos, sin
