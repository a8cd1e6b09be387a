"""SiLU-and-multiply, the gated activation of Llama-style MLPs.

``out = silu(gate) * up``, with the SiLU rounded to the model dtype before the
product as Hugging Face computes ``act_fn(gate_proj(x)) * up_proj(x)``.

For FP8 models ``silu_and_mul_quant_fp8`` also quantizes each row of the model-dtype product per token to E4M3
(``fp8_quant``'s arithmetic, bit-identical to quantizing ``silu_and_mul``'s output), one program per row: the
down projection skips its quantization launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, next_pow2
from .fp8_quant import MIN_SCALE, QuantizedActivation, e4m3_scale, finish, fp8_out_buffers, to_e4m3

_SINGLE_PASS_MAX = 16384   # a row up to this many columns is held in registers (Llama-8B's intermediate: 14336)
_LOOP_BLOCK = 4096


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, n_cols, up_offset,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_u + up_offset + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[..., I]`` tensors."""
    check_tensor("gate", gate, dtype=SUPPORTED_DTYPES)
    check_tensor("up", up, dtype=gate.dtype, device=gate.device)
    if not (gate.shape == up.shape):
        fail("up", f"shape {tuple(up.shape)} != gate {tuple(gate.shape)}")
    if not (gate.dim() >= 1):
        fail("gate", "needs at least one dim")
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    _launch(g2, u2, out, 0)
    return out.view(gate.shape)


def _launch(g2: torch.Tensor, u2: torch.Tensor, out: torch.Tensor, up_offset: int) -> None:
    rows, n = out.shape
    if rows > 0 and n > 0:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, up_offset, BLOCK=block, num_warps=4,
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]``: first half is the gate, second half the up projection."""
    check_tensor("x", x, dtype=SUPPORTED_DTYPES)
    if not (x.dim() >= 1 and x.shape[-1] % 2 == 0):
        fail("x", f"last dim of shape {tuple(x.shape)} must be even")
    half = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty((x2.shape[0], half), dtype=x.dtype, device=x.device)
    _launch(x2, x2, out, half)  # one pointer: the up half starts `half` columns in
    return out.view(*x.shape[:-1], half)


@triton.jit
def _silu_mul_row(x_row, cols, mask, up_offset):
    g = tl.load(x_row + cols, mask=mask, other=0.0)
    u = tl.load(x_row + up_offset + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)   # the model-dtype product


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, min_scale,
    BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr, CAST_IN_TORCH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if SINGLE_PASS:
        mask = cols < n_cols
        y = _silu_mul_row(x_row, cols, mask, n_cols)
        scale = e4m3_scale(tl.max(tl.abs(y), 0), min_scale)
        tl.store(q_row + cols, to_e4m3(y, scale, q_ptr, CAST_IN_TORCH), mask=mask)
    else:   # the row twice: its amax, then the values (recomputed: cheaper than a round trip through memory)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            amax = tl.maximum(amax, tl.abs(_silu_mul_row(x_row, start + cols, mask, n_cols)))
        scale = e4m3_scale(tl.max(amax, 0), min_scale)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            q = to_e4m3(_silu_mul_row(x_row, start + cols, mask, n_cols), scale, q_ptr, CAST_IN_TORCH)
            tl.store(q_row + start + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def silu_and_mul_quant_fp8(x: torch.Tensor) -> QuantizedActivation:
    """``silu_and_mul(x)`` quantized per token to E4M3 in one kernel: ``[..., 2I]`` -> values ``[T, I]``."""
    check_tensor("x", x, dtype=SUPPORTED_DTYPES)
    if not (x.dim() >= 1 and x.shape[-1] % 2 == 0):
        fail("x", f"last dim of shape {tuple(x.shape)} must be even")
    half = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    q, scale, cast_in_torch = fp8_out_buffers(rows, half, x.device)
    if rows == 0 or half == 0:
        return finish(q, scale.fill_(MIN_SCALE), x.dtype)
    single = half <= _SINGLE_PASS_MAX
    block = next_pow2(half) if single else _LOOP_BLOCK
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _silu_mul_quant_kernel[(rows,)](
        x2, q, scale, x2.stride(0), q.stride(0), half, MIN_SCALE,
        BLOCK=block, SINGLE_PASS=single, CAST_IN_TORCH=cast_in_torch, num_warps=warps,
    )
    return finish(q, scale, x.dtype)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference."""
    return torch.nn.functional.silu(gate) * up
