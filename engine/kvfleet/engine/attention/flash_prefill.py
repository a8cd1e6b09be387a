"""Prefill attention through PyTorch's FlashAttention-2 varlen kernel (``KVFLEET_PREFILL_ATTENTION=flash``).

Issue 16's long-prompt and shared-prefix rows lose to vLLM, whose prefill runs FlashAttention-3; our Triton
prefill kernel measured ~190 TFLOP/s on the H200 (bench/NOTES.md). PyTorch ships FlashAttention-2
(``torch.nn.attention.varlen.varlen_attn``), which takes packed sequences but not a paged cache, so for
the sequences of a step that have more than one new token this gathers each one's keys and values
(its cached prefix and its new tokens, already written to the cache) into packed K/V, runs the varlen kernel
causally (aligned to the last key: query i of a chunk after ``ctx`` cached tokens sees keys ``0..ctx+i``),
and scatters the rows back. Rows of single-token (decode) sequences are left to the decode kernel. The
gather moves each prefill key once per layer (~40 us per layer for 16k keys on an H200): small beside the
attention itself at these lengths. An A/B switch until the GPU says which wins (bench/compare_vllm.sh
``ab-prefill``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

AttnFn = Callable[..., torch.Tensor]


def prefill_impl() -> str:
    raw = os.environ.get("KVFLEET_PREFILL_ATTENTION", "triton").strip().lower() or "triton"
    if raw not in ("triton", "flash"):
        raise ValueError(f"KVFLEET_PREFILL_ATTENTION: 'triton' or 'flash', got {raw!r}")
    return raw


@dataclass(frozen=True)
class FlashPlan:
    """Index tensors of one step, built once (first layer) from the host copies of the metadata."""

    q_rows: torch.Tensor | None    # int64 rows of q that belong to prefill sequences; None: all rows, in order
    k_slots: torch.Tensor | None   # int64 cache slots of every key of every prefill sequence; None: no prefix
    cu_q: torch.Tensor             # int32 [n + 1]
    cu_k: torch.Tensor             # int32 [n + 1]
    max_q: int
    max_k: int


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type == "cuda":   # pinned + non-blocking: no wait for the step in flight (async scheduling)
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flash_plan(qsl: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
               device: torch.device) -> FlashPlan | None:
    """The plan for a step's sequences with more than one new token; None if it has none."""
    seqs = [b for b in range(len(seq_lens)) if qsl[b + 1] - qsl[b] > 1]
    if not seqs:
        return None
    q_lens = np.array([qsl[b + 1] - qsl[b] for b in seqs], dtype=np.int64)
    k_lens = np.array([seq_lens[b] for b in seqs], dtype=np.int64)
    cu_q = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu_k = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu_q[1:])
    np.cumsum(k_lens, out=cu_k[1:])
    all_rows = len(seqs) == len(seq_lens) and qsl[-1] == int(q_lens.sum())
    q_rows = None if all_rows else _to(np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in seqs]), device)
    has_prefix = bool((k_lens > q_lens).any())
    k_slots = None
    if has_prefix:
        seq_idx = np.repeat(np.array(seqs, dtype=np.int64), k_lens)
        pos = np.concatenate([np.arange(n, dtype=np.int64) for n in k_lens])
        idx = _to(np.stack([seq_idx, pos]), device)
        blocks = block_tables[idx[0], idx[1] // block_size].to(torch.int64)
        k_slots = blocks * block_size + idx[1] % block_size
    return FlashPlan(q_rows, k_slots, _to(cu_q, device), _to(cu_k, device), int(q_lens.max()), int(k_lens.max()))


_GQA: dict[str, bool] = {"native": True}   # False once the kernel refused fewer K/V heads than query heads


def torch_varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                      max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """PyTorch's FlashAttention-2 varlen kernel, causal (window (-1, 0): aligned to the last key). GQA heads go
    in as they are (FlashAttention-2 takes num_heads_k dividing num_heads); should this PyTorch build refuse
    them, K/V are expanded to the query heads from then on."""
    from torch.nn.attention.varlen import varlen_attn

    g = q.shape[1] // k.shape[1]
    if g > 1 and not _GQA["native"]:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    try:
        out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))
        assert isinstance(out, torch.Tensor)   # a tuple only when asked for the log-sum-exp
        return out
    except RuntimeError:
        if g == 1 or not _GQA["native"]:
            raise
        _GQA["native"] = False
        return torch_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def varlen_causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                            cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """The same function in plain PyTorch (float32), sequence by sequence: the CPU tests' stand-in."""
    out = torch.empty_like(q)
    g = q.shape[1] // k.shape[1]
    for i in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi = q[qs:qe].float().transpose(0, 1)                                  # [H, Lq, D]
        ki = k[ks:ke].float().repeat_interleave(g, dim=1).transpose(0, 1)       # [H, Lk, D]
        vi = v[ks:ke].float().repeat_interleave(g, dim=1).transpose(0, 1)
        s = qi @ ki.transpose(1, 2) * scale
        lq, lk = qe - qs, ke - ks
        visible = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + (lk - lq))
        s = s.masked_fill(~visible.to(s.device), float("-inf"))
        out[qs:qe] = (s.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return out


def flash_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_cache: torch.Tensor,
                  plan: FlashPlan, scale: float, out: torch.Tensor, attn: AttnFn = torch_varlen_attn) -> None:
    """Attention of the plan's prefill rows into ``out`` (the step's K/V already written to ``kv_cache``)."""
    if plan.k_slots is None:   # no cached prefix: the new tokens are all the keys
        keys = k_new if plan.q_rows is None else k_new.index_select(0, plan.q_rows)
        values = v_new if plan.q_rows is None else v_new.index_select(0, plan.q_rows)
    else:
        hkv, d = kv_cache.shape[3], kv_cache.shape[4]
        keys = kv_cache[0].reshape(-1, hkv, d).index_select(0, plan.k_slots)
        values = kv_cache[1].reshape(-1, hkv, d).index_select(0, plan.k_slots)
    queries = q if plan.q_rows is None else q.index_select(0, plan.q_rows)
    # q/k/v of a step are views of the fused qkv projection (rows strided): dense for the kernel
    queries, keys, values = queries.contiguous(), keys.contiguous(), values.contiguous()
    res = attn(queries, keys, values, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale)
    if plan.q_rows is None:
        out.copy_(res)
    else:
        out.index_copy_(0, plan.q_rows, res)


def plan_for(md: Any, block_size: int, device: torch.device) -> FlashPlan | None:
    """The step's plan, computed by the first layer and kept on the metadata object for the others."""
    if not hasattr(md, "_kvfleet_flash_plan"):
        md._kvfleet_flash_plan = flash_plan(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, block_size,
                                            device)
    plan: FlashPlan | None = md._kvfleet_flash_plan
    return plan
