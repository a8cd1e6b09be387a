"""Write the new tokens' K and V into the paged KV cache (vLLM's reshape_and_cache).

Cache layout (docs/engine-interfaces.md): ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``; token ``i`` goes to slot ``slot_mapping[i]`` = ``block * block_size +
offset``; a slot of -1 means "skip" (padding in CUDA-graph batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import SUPPORTED_DTYPES, check_tensor, fail, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_blk, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (in place)."""
    check_tensor("kv_cache", kv_cache, ndim=5, dtype=SUPPORTED_DTYPES)
    if not (kv_cache.shape[0] == 2):
        fail("kv_cache", f"first dim must be 2 (K, V), got {kv_cache.shape[0]}")
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndim=3, dtype=kv_cache.dtype, device=kv_cache.device)
        if not (t.shape[1:] == (hkv, d)):
            fail(name, f"shape {tuple(t.shape)} does not match cache heads/dim {(hkv, d)}")
    if not (k.shape[0] == v.shape[0]):
        fail("v", "k and v must have the same number of tokens")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtype=(torch.int64, torch.int32), device=kv_cache.device)
    if not (slot_mapping.shape[0] == k.shape[0]):
        fail("slot_mapping", f"length {slot_mapping.shape[0]} != tokens {k.shape[0]}")
    if not (kv_cache.stride(4) == 1):
        fail("kv_cache", "head_dim must be contiguous")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=block_size,
        H_PAD=next_pow2(hkv), D_PAD=next_pow2(d),
    )


def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Plain-PyTorch reference: same effect as :func:`reshape_and_cache`."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0, slots] = k[keep]
    flat[1, slots] = v[keep]
