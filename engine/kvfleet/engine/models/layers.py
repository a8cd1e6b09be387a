"""Small building blocks of the decoder: RMSNorm, rotary embedding tables, SiLU-and-mul.

(The rotation itself is the attention op's: `kvfleet.engine.rope.apply_rotary` on the torch path, fused
with the KV-cache write on the Triton one.)

Numerics follow transformers' Llama code step by step (float32 norm statistics,
cos/sin computed in float32 then cast) so float32 results match it closely. On CUDA
tensors each runs as one fused Triton kernel (`kvfleet.engine.kernels`, same numerics)
unless KVFLEET_FUSED_KERNELS=0 (kept for A/B checks against the torch path).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine import kernels
from kvfleet.engine.head_norm import rms_norm_torch
from kvfleet.engine.rope import apply_rotary, rope_inv_freq

__all__ = ["RMSNorm", "RotaryEmbedding", "apply_rotary", "silu_and_mul"]


class RMSNorm(nn.Module):
    """``quant_fp8`` (set when an FP8 linear layer reads the output): on CUDA the kernel quantizes its output per
    token and returns a ``kernels.QuantizedActivation``; elsewhere the output stays a tensor (the layer
    quantizes it)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.quant_fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | kernels.QuantizedActivation:
        if _fused(x):
            if self.quant_fp8:
                return kernels.rms_norm_quant_fp8(x, self.weight, self.eps)
            return kernels.rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor,
                     residual: torch.Tensor) -> tuple[torch.Tensor | kernels.QuantizedActivation, torch.Tensor]:
        """h = x + residual -> (norm(h), h); one fused kernel on CUDA."""
        if _fused(x):
            if self.quant_fp8:
                return kernels.fused_add_rms_norm_quant_fp8(x, residual, self.weight, self.eps)
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self.forward(h), h


# read once, like the kernels it selects: "0" keeps the torch path on CUDA too (A/B checks)
FUSED_KERNELS = os.environ.get("KVFLEET_FUSED_KERNELS", "1") != "0"


def _fused(x: torch.Tensor) -> bool:
    """Use the Triton kernels for CUDA tensors unless KVFLEET_FUSED_KERNELS=0."""
    return FUSED_KERNELS and x.is_cuda


def silu_and_mul(x: torch.Tensor, quant_fp8: bool = False) -> torch.Tensor | kernels.QuantizedActivation:
    """x = [gate | up] along the last dim -> silu(gate) * up; with ``quant_fp8`` on CUDA quantized per token in
    the same kernel (for an FP8 linear layer)."""
    if _fused(x):
        return kernels.silu_and_mul_quant_fp8(x) if quant_fp8 else kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# read once: "0" computes the rotary tables with torch ops (seven small kernels a step), the A/B baseline
ROPE_TABLE_KERNEL = os.environ.get("KVFLEET_ROPE_TABLES", "1") != "0"


class RotaryEmbedding(nn.Module):
    """cos/sin per position, computed on the fly (no max-length cache to size)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype` (one kernel on CUDA unless KVFLEET_ROPE_TABLES=0)."""
        if ROPE_TABLE_KERNEL and _fused(positions):
            return kernels.rope_tables(positions, self.inv_freq.to(torch.float32), dtype)
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

