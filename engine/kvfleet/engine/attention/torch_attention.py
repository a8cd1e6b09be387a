"""The pure-PyTorch paged attention op: the reference path, on CPU and GPU.

Decode tokens (one query per sequence) are handled together in one batched
gather + matmul; prefill (and chunked-prefill) sequences one at a time through
scaled_dot_product_attention with a causal mask offset by the cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.head_norm import QKNorm, apply_qk_norm
from kvfleet.engine.rope import Rotary, apply_rotary


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's K/V at their slots (-1 = skip). kv_cache: [2, blocks, block_size, Hkv, D]."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        idx = slot_mapping
    else:
        idx = slot_mapping[valid]
        k, v = k[valid], v[valid]
    flat[0].index_copy_(0, idx, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, idx, v.to(kv_cache.dtype))


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """cache [blocks, bs, Hkv, D], block_ids [..., n] -> [..., n*bs, Hkv, D] truncated to `length`."""
    gathered = cache[block_ids.long()]
    shape = gathered.shape
    gathered = gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return gathered[..., :length, :, :]


def _decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Hq, D], one query per sequence at its last position -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_len = int(seq_lens.max())
    n_blocks = -(-max_len // block_size)
    tables = block_tables[:, :n_blocks]
    keys = _gather_context(kv_cache[0], tables, max_len)      # [B, S, Hkv, D]
    values = _gather_context(kv_cache[1], tables, max_len)
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, keys).float() * scale
    pos = torch.arange(max_len, device=q.device)
    scores.masked_fill_((pos[None, :] >= seq_lens[:, None].long())[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values)
    return out.reshape(batch, num_heads, head_dim)


def _prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """q [L, Hq, D] = the last L positions of a sequence of seq_len -> [L, Hq, D]."""
    q_len = q.shape[0]
    block_size = kv_cache.shape[2]
    n_blocks = -(-seq_len // block_size)
    keys = _gather_context(kv_cache[0], block_table[:n_blocks], seq_len).to(q.dtype)   # [S, Hkv, D]
    values = _gather_context(kv_cache[1], block_table[:n_blocks], seq_len).to(q.dtype)
    qt, kt, vt = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # query i sits at absolute position seq_len - q_len + i and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    rotary: Rotary | None = None,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; normalises each head of q and k by `qk_norm` and rotates
    them by `rotary` when given, then writes k/v into kv_cache."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of {k.shape[1]} KV heads")
    if qk_norm is not None:
        q, k = apply_qk_norm(q, k, qk_norm)
    if rotary is not None:
        q, k = apply_rotary(q, rotary.cos, rotary.sin), apply_rotary(k, rotary.cos, rotary.sin)
    write_kv(k, v, kv_cache, attn_metadata.slot_mapping)
    out = torch.empty_like(q)
    qsl = attn_metadata.query_start_loc_cpu
    seq_lens = attn_metadata.seq_lens_cpu
    decode_seqs = [b for b in range(len(seq_lens)) if qsl[b + 1] - qsl[b] == 1]
    if decode_seqs:
        rows = torch.tensor(decode_seqs, device=q.device)
        tokens = torch.tensor([qsl[b] for b in decode_seqs], device=q.device)
        out[tokens] = _decode(
            q[tokens], kv_cache, attn_metadata.block_tables[rows], attn_metadata.seq_lens[rows], scale
        ).to(q.dtype)
    decode_set = set(decode_seqs)
    for b in range(len(seq_lens)):
        start, end = qsl[b], qsl[b + 1]
        if b in decode_set or end == start:
            continue
        out[start:end] = _prefill(q[start:end], kv_cache, attn_metadata.block_tables[b], seq_lens[b], scale)
    return out
