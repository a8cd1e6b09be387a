"""RMSNorm in plain PyTorch, and the per-head RMSNorm of queries and keys before rotary (Qwen3's q_norm/k_norm),
shared by the model code and the attention backends (a leaf: torch only).

The model hands the two norms to the attention backend instead of running them itself, so a backend can fuse them
into the kernel that already reads every query and key head to rotate them (the Triton backend's rotary + cache
write): no launches and no copies of the strided q/k views of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with transformers' numerics: the mean of squares and the scaling in float32, the
    normalised value rounded to x's dtype, then times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class QKNorm(NamedTuple):
    """RMSNorm weights ``[head_dim]`` for every query head and every key head, and their epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def apply_qk_norm(q: torch.Tensor, k: torch.Tensor, norm: QKNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, Hq, D]``, k ``[T, Hkv, D]`` -> each head normalised (new tensors)."""
    return rms_norm_torch(q, norm.q_weight, norm.eps), rms_norm_torch(k, norm.k_weight, norm.eps)
