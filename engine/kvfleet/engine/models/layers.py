"""Small building blocks of the decoder: RMSNorm, rotary embedding, SiLU-and-mul.

Numerics follow transformers' Llama code step by step (float32 norm statistics,
cos/sin computed in float32 then cast) so float32 results match it closely.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x):  # one Triton kernel on CUDA (kvfleet.engine.kernels.rms_norm), same numerics
            from kvfleet.engine.kernels import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h = x + residual -> (norm(h), h); one fused kernel on CUDA."""
        if _fused(x):
            from kvfleet.engine.kernels import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self.forward(h), h


def _fused(x: torch.Tensor) -> bool:
    """Use the Triton kernels (kvfleet.engine.kernels) for CUDA tensors unless KVFLEET_FUSED_KERNELS=0."""
    if not x.is_cuda:
        return False
    from kvfleet.engine.kernels import fused_kernels_enabled

    return fused_kernels_enabled(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if _fused(x):
        from kvfleet.engine.kernels import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies for rotary embedding (default, linear, or Llama-3 scaling); float32 [head_dim/2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"rope_scaling: rope type {kind!r} is not supported")
    factor = float(scaling["factor"])
    low_ff = float(scaling["low_freq_factor"])
    high_ff = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin per position, computed on the fly (no max-length cache to size)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype`."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq.to(torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (NeoX/HF half-split layout), cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D]; on CUDA in place by one Triton kernel."""
    if _fused(q):
        from kvfleet.engine.kernels import apply_rotary_cos_sin

        apply_rotary_cos_sin(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
