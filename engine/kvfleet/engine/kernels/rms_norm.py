"""RMSNorm, optionally fused with the residual add that precedes it.

Numerics follow Hugging Face's ``LlamaRMSNorm`` so outputs match transformers:
the residual add is rounded to the model dtype, the mean of squares and the
scaling run in float32, the normalised value is rounded to the model dtype and
then multiplied by the weight (rounded again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
    check_tensor("x", x, dtype=SUPPORTED_DTYPES)
    if not (x.dim() >= 1):
        fail("x", "needs at least one dim")
    n = x.shape[-1]
    check_tensor("weight", weight, ndim=1, device=x.device)
    if not (weight.shape[0] == n):
        fail("weight", f"size {weight.shape[0]} != hidden size {n}")
    if not (eps > 0):
        fail("eps", f"must be > 0, got {eps}")
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    if residual is not None:
        check_tensor("residual", residual, dtype=x.dtype, device=x.device)
        if not (residual.shape == x.shape):
            fail("residual", f"shape {tuple(residual.shape)} != x {tuple(x.shape)}")
        r2 = residual.reshape(-1, n)
        res_out = torch.empty_like(x2)
    else:
        r2 = res_out = x2
    if rows > 0:
        block = next_pow2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            n, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape), (res_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape)."""
    return _launch(x, weight, eps, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)``."""
    out, res = _launch(x, weight, eps, residual)
    assert res is not None
    return out, res


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-PyTorch reference (Hugging Face's LlamaRMSNorm numerics)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), (x if residual is not None else None)
