"""Dynamic per-token FP8 (E4M3) quantization of activations in one kernel.

The eager PyTorch form (float cast, abs, amax, divide, clamp, cast: eight launches and three full passes over
the activation per linear layer) cost more than the FP8 matmul saved (H200 profile, issue 16: 0.13 ms against
a 0.03 ms bf16 GEMV at one token). Here one program reads its row once, finds the row's largest magnitude,
and writes the E4M3 values and the float32 scale, the same arithmetic as the reference
(``kvfleet.engine.models.fp8.quantize_per_row``): ``scale = max(amax / 448, 1e-12)``,
``q = clamp(x / scale, -448, 448)`` rounded to the nearest E4M3 value.

Triton's CPU interpreter emulates the E4M3 cast wrongly (subnormals, and values just below a power of two:
31.98 -> 16), so when interpreting the kernel stores the clamped float32 values and PyTorch casts them
(``CAST_IN_TORCH``), as the other kernels widen ``tl.dot`` operands there; compiled kernels cast on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, interpret_mode, next_pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
_SINGLE_PASS_MAX = 16384   # a row up to this many columns is held in registers (Llama-8B's widest: 14336)
_LOOP_BLOCK = 4096


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, min_scale,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, CAST_IN_TORCH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, min_scale)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        if not CAST_IN_TORCH:
            q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_row + cols, q, mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, min_scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
            if not CAST_IN_TORCH:
                q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(q_row + start + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp16/fp32) -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, 1]``), ``x ~= q * scale``
    row by row."""
    check_tensor("x", x, dtype=SUPPORTED_DTYPES, ndim=2)
    if x.stride(1) != 1:
        fail("x", "its last dimension must be contiguous")
    rows, n_cols = x.shape
    cast_in_torch = interpret_mode()
    q = torch.empty((rows, n_cols), dtype=torch.float32 if cast_in_torch else FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0 or n_cols == 0:
        return q.to(FP8_DTYPE), scale.fill_(MIN_SCALE)
    single = n_cols <= _SINGLE_PASS_MAX
    block = next_pow2(n_cols) if single else _LOOP_BLOCK
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _per_token_quant_kernel[(rows,)](
        x, q, scale, x.stride(0), q.stride(0), n_cols, MIN_SCALE,
        BLOCK=block, SINGLE_PASS=single, CAST_IN_TORCH=cast_in_torch, num_warps=warps,
    )
    return (q.to(FP8_DTYPE) if cast_in_torch else q), scale
