"""Rotary-embedding math shared by the model code and the kernels' callers (a leaf: torch only)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch


class Rotary(NamedTuple):
    """Per-token rotary tables in Hugging Face's layout (both halves equal): cos, sin [T, head_dim]."""

    cos: torch.Tensor
    sin: torch.Tensor


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (NeoX/HF half-split layout), cos/sin [T, D]: transformers' apply_rotary_pos_emb."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies for rotary embedding (default, linear, or Llama-3 scaling); float32 [head_dim/2].
    Numerics follow transformers' rope init functions step by step."""
    if not (head_dim > 0 and head_dim % 2 == 0):
        raise ValueError(f"head_dim: must be positive and even, got {head_dim}")
    if not (theta > 0):
        raise ValueError(f"rope_theta: must be > 0, got {theta}")
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
