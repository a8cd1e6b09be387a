"""Fresh prompts through PyTorch's fused attention (issue 16's long-prompt row).

A fresh prompt, a sequence whose keys are all new in this step (no cached prefix), needs no block table: its
attention is causal self-attention over the step's own q/k/v rows, which
`torch.nn.functional.scaled_dot_product_attention` runs with cuDNN's (or FlashAttention's) fused kernel.
KVFLEET_SDPA_PREFILL names the backend ("" = off, the default: the Triton prefill kernel takes every prompt);
prompts shorter than KVFLEET_SDPA_PREFILL_MIN_TOKENS stay with the Triton kernel (one call a prompt and layer
costs host time, and short prompts are a small share of a step's attention).

cuDNN builds an execution plan per shape, so each prompt's length is rounded up to KVFLEET_SDPA_PREFILL_BUCKET
tokens. The rows past the prompt's end are the step's next rows (or zeros past the step's last row): with the
causal mask, top-left aligned, no real query sees a key past its own position, and the padded queries' rows are
not copied out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass(frozen=True)
class SdpaPrefillConfig:
    """Which prompts go to SDPA and how: `backend` None = none (the Triton kernel takes every prompt)."""

    backend: str | None = None
    min_tokens: int = 1024
    bucket: int = 256


def _positive_int(name: str, raw: str, default: int) -> int:
    if not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError as e:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}") from e
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}")
    return value


def sdpa_prefill_config(backend: str, min_tokens: str = "", bucket: str = "") -> SdpaPrefillConfig:
    """Pure: the config from the three knobs' raw values (ValueError names the knob)."""
    name = backend.strip() or None
    if name is not None and name not in SDPA_BACKENDS:
        raise ValueError(f"KVFLEET_SDPA_PREFILL: expected one of {', '.join(SDPA_BACKENDS)} or empty, got {backend!r}")
    defaults = SdpaPrefillConfig()
    return SdpaPrefillConfig(name, _positive_int("KVFLEET_SDPA_PREFILL_MIN_TOKENS", min_tokens, defaults.min_tokens),
                             _positive_int("KVFLEET_SDPA_PREFILL_BUCKET", bucket, defaults.bucket))


def config_from_env() -> SdpaPrefillConfig:
    return sdpa_prefill_config(os.environ.get("KVFLEET_SDPA_PREFILL", ""),
                               os.environ.get("KVFLEET_SDPA_PREFILL_MIN_TOKENS", ""),
                               os.environ.get("KVFLEET_SDPA_PREFILL_BUCKET", ""))


def fresh_prompt_seqs(query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
                      config: SdpaPrefillConfig) -> tuple[int, ...]:
    """Pure: the sequences of a step that SDPA attends: every key new in this step, at least `min_tokens` of them."""
    if config.backend is None:
        return ()
    floor = max(2, config.min_tokens)
    return tuple(b for b in range(len(seq_lens_cpu))
                 if (n := query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]) == seq_lens_cpu[b] and n >= floor)


def _bucketed_rows(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """`x[start:start + length]` ``[L, H, D]`` as ``[1, H, L, D]``, its rows past `start + n` being x's next rows or
    zeros (see the module's note)."""
    end = start + length
    if end <= x.shape[0]:
        rows = x[start:end]
    else:
        rows = x.new_zeros((length,) + tuple(x.shape[1:]))
        rows[:x.shape[0] - start] = x[start:]
    return rows.unsqueeze(0).transpose(1, 2)


def attend_fresh_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         query_start_loc_cpu: list[int], seqs: tuple[int, ...], scale: float,
                         config: SdpaPrefillConfig) -> None:
    """Causal attention of each of `seqs` over its own rows of q ``[T, Hq, D]`` and (rotated) k/v ``[T, Hkv, D]``,
    written into out ``[T, Hq, D]``. The chosen backend first; FlashAttention's and the memory-efficient kernel
    stand behind it where it cannot take a shape (never silently the O(L^2)-memory math path, unless chosen)."""
    assert config.backend is not None
    chosen = SDPA_BACKENDS[config.backend]
    order = [chosen] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION) if b != chosen]
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(order, set_priority=True):
        for b in seqs:
            start, n = query_start_loc_cpu[b], query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]
            length = -(-n // config.bucket) * config.bucket
            o = F.scaled_dot_product_attention(_bucketed_rows(q, start, length), _bucketed_rows(k, start, length),
                                               _bucketed_rows(v, start, length), is_causal=True, scale=scale,
                                               enable_gqa=gqa)
            out[start:start + n].copy_(o[0, :, :n].transpose(0, 1))
