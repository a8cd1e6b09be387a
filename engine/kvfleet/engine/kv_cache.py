"""Operations on the paged KV cache tensors (layout: docs/engine-interfaces.md, one
`[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer), shared by every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def allocate_kv_cache(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """One zeroed cache tensor of `shape` per layer."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: block dst[i] of every layer becomes a copy of block src[i] (long index tensors
    on the caches' device)."""
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def block_pairs(pairs: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) index tensors of (src, dst) block pairs."""
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    return src, dst
