"""RMSNorm, optionally fused with the residual add that precedes it.

Numerics follow Hugging Face's ``LlamaRMSNorm`` so outputs match transformers:
the residual add is rounded to the model dtype, the mean of squares and the
scaling run in float32, the normalised value is rounded to the model dtype and
then multiplied by the weight (rounded again).

For FP8 models (``rms_norm_quant_fp8``, ``fused_add_rms_norm_quant_fp8``) the same kernel then quantizes its
output row per token, as ``fp8_quant.per_token_quant_fp8`` would quantize the model-dtype output (bit-identical:
the same arithmetic on the same rounded values), and writes only the E4M3 values and the scale: the next linear
layer skips its quantization launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, next_pow2
from .fp8_quant import MIN_SCALE, QuantizedActivation, e4m3_scale, finish, fp8_out_buffers, to_e4m3


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_q,
    n_cols, eps, min_scale,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, CAST_IN_TORCH: tl.constexpr,
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
    if QUANT:   # per-token E4M3 of the model-dtype output (fp8_quant's arithmetic)
        y = y.to(x.dtype).to(tl.float32)
        scale = e4m3_scale(tl.max(tl.abs(y), 0), min_scale)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(y, scale, q_ptr, CAST_IN_TORCH), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            quant: bool = False) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor | None]:
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
    rows = x2.shape[0]
    out = x2 if quant else torch.empty_like(x2)   # quantized: only the E4M3 values and scales are written
    q, scale, cast_in_torch = fp8_out_buffers(rows, n, x.device) if quant else (x2, x2, False)
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
            x2, r2, weight, out, res_out, q, scale,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), q.stride(0),
            n, float(eps), MIN_SCALE,
            HAS_RESIDUAL=residual is not None, BLOCK=block, QUANT=quant, CAST_IN_TORCH=cast_in_torch,
            num_warps=min(16, max(1, block // 256)),
        )
    res = res_out.view(x.shape) if residual is not None else None
    if quant:
        if rows == 0:
            scale.fill_(MIN_SCALE)
        return finish(q, scale, x.dtype), res
    return out.view(x.shape), res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape)."""
    out = _launch(x, weight, eps, None)[0]
    assert isinstance(out, torch.Tensor)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)``."""
    out, res = _launch(x, weight, eps, residual)
    assert isinstance(out, torch.Tensor) and res is not None
    return out, res


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedActivation:
    """``rms_norm(x)`` quantized per token to E4M3, in one kernel; ``x [..., H]`` -> values ``[T, H]``."""
    out = _launch(x, weight, eps, None, quant=True)[0]
    assert isinstance(out, QuantizedActivation)
    return out


def fused_add_rms_norm_quant_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[QuantizedActivation, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h) quantized per token, h)`` in one kernel."""
    out, res = _launch(x, weight, eps, residual, quant=True)
    assert isinstance(out, QuantizedActivation) and res is not None
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
