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

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, interpret_mode, next_pow2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
_SINGLE_PASS_MAX = 16384   # a row up to this many columns is held in registers (Llama-8B's widest: 14336)
_LOOP_BLOCK = 4096


@dataclasses.dataclass(frozen=True)
class QuantizedActivation:
    """Activations already quantized per token for an FP8 linear layer (what the fused RMSNorm and SiLU-and-mul
    kernels hand it, so it skips its own quantization launch): ``values [T, K]`` float8_e4m3fn, ``scales [T, 1]``
    float32 (``x ~= values * scales`` row by row), ``dtype`` the model dtype the layer returns."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.values.dim() != 2 or self.values.dtype != FP8_DTYPE:
            raise ValueError(f"values: expected a 2-D float8_e4m3fn tensor, got {self.values.dtype} "
                             f"{tuple(self.values.shape)}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (self.values.shape[0], 1):
            raise ValueError(f"scales: expected float32 [{self.values.shape[0]}, 1], got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")

    def dequantize(self) -> torch.Tensor:
        """float32 ``values * scales`` (the reference path's input)."""
        return self.values.float() * self.scales


def fp8_out_buffers(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(values buffer, float32 scales [rows, 1], cast_in_torch): the values buffer is float32 when the
    interpreter runs the kernel (PyTorch casts it, see the module docstring), E4M3 otherwise."""
    cast_in_torch = interpret_mode()
    q = torch.empty((rows, cols), dtype=torch.float32 if cast_in_torch else FP8_DTYPE, device=device)
    return q, torch.empty((rows, 1), dtype=torch.float32, device=device), cast_in_torch


def finish(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> QuantizedActivation:
    """The buffers of ``fp8_out_buffers`` after a kernel wrote them, as a QuantizedActivation."""
    return QuantizedActivation(q.to(FP8_DTYPE) if q.dtype != FP8_DTYPE else q, scale, dtype)


@triton.jit
def e4m3_scale(amax, min_scale):
    """A row's scale from its largest magnitude: ``max(amax / 448, min_scale)``."""
    return tl.maximum(amax / 448.0, min_scale)


@triton.jit
def to_e4m3(y, scale, q_ptr, CAST_IN_TORCH: tl.constexpr):
    """``clamp(y / scale, -448, 448)``, rounded to E4M3 on the GPU (kept float32 for PyTorch to cast when
    interpreted: ``CAST_IN_TORCH``)."""
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    if not CAST_IN_TORCH:
        q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return q


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
        scale = e4m3_scale(tl.max(tl.abs(x), 0), min_scale)
        tl.store(q_row + cols, to_e4m3(x, scale, q_ptr, CAST_IN_TORCH), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = e4m3_scale(tl.max(amax, 0), min_scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + start + cols, to_e4m3(x, scale, q_ptr, CAST_IN_TORCH), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp16/fp32) -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, 1]``), ``x ~= q * scale``
    row by row."""
    check_tensor("x", x, dtype=SUPPORTED_DTYPES, ndim=2)
    if x.stride(1) != 1:
        fail("x", "its last dimension must be contiguous")
    rows, n_cols = x.shape
    q, scale, cast_in_torch = fp8_out_buffers(rows, n_cols, x.device)
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
