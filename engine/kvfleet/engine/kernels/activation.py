"""SiLU-and-multiply, the gated activation of Llama-style MLPs.

``out = silu(gate) * up``, with the SiLU rounded to the model dtype before the
product as Hugging Face computes ``act_fn(gate_proj(x)) * up_proj(x)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail


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


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference."""
    return torch.nn.functional.silu(gate) * up
