"""Attention backends. Every backend has the signature of `torch_paged_attention`:

    out = attention(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D], kv_cache, attn_metadata, scale,
                    rotary=None, qk_norm=None) -> [T, Hq, D]

`rotary` (`kvfleet.engine.rope.Rotary`, per-token cos/sin) asks the backend to rotate q and k
before it caches k and attends, so a backend can fuse the rotation into its cache write (the
Triton one does: one kernel instead of two per layer); q may be rotated in place. `qk_norm`
(`kvfleet.engine.head_norm.QKNorm`, Qwen3's per-head RMSNorm) asks it to normalise each head
of q and k before that; the Triton backend does it in the same kernel.

The torch path is registered here; the Triton path (`triton_backend.py`, over
`kvfleet.engine.kernels`) is imported and registered for CUDA when a backend is first
chosen, and `get_attention_backend` prefers it there. Others may be added with
`register_attention_backend(name, fn, device_types, priority)`. The environment
variable KVFLEET_ATTENTION_BACKEND (or the `name` argument) forces one by name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata, build_attention_metadata
from kvfleet.engine.attention.torch_attention import torch_paged_attention

logger = logging.getLogger(__name__)

AttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class _Backend:
    name: str
    fn: AttentionFn
    device_types: tuple[str, ...]
    priority: int


_BACKENDS: dict[str, _Backend] = {}


def register_attention_backend(
    name: str, fn: AttentionFn, device_types: Iterable[str] = ("cuda",), priority: int = 10
) -> None:
    """Make `fn` available; among the backends for a device the highest priority wins by default."""
    _BACKENDS[name] = _Backend(name, fn, tuple(device_types), priority)


register_attention_backend("torch", torch_paged_attention, ("cpu", "cuda"), priority=0)


_optional_loaded = False


def _load_optional_backends() -> None:
    """Register the Triton backend once (imported late: it compiles kernels; triton may be absent)."""
    global _optional_loaded
    if _optional_loaded:
        return
    _optional_loaded = True
    try:
        from kvfleet.engine.attention.triton_backend import triton_paged_attention
    except ImportError:
        return
    except ValueError:
        raise   # a KVFLEET_* setting it reads is wrong (the error names it): a mistake to report, not a fallback
    except Exception as exc:  # a broken optional backend must not take the torch path down
        logger.warning("attention kernels unavailable: %s", exc)
        return
    register_attention_backend("triton", triton_paged_attention, device_types=("cuda",), priority=10)


def get_attention_backend(device: str | torch.device, name: str | None = None) -> AttentionFn:
    device_type = torch.device(device).type
    _load_optional_backends()
    name = name or os.environ.get("KVFLEET_ATTENTION_BACKEND") or None
    if name is not None:
        if name not in _BACKENDS:
            raise ValueError(f"attention_backend: {name!r} is not one of {sorted(_BACKENDS)}")
        backend = _BACKENDS[name]
        if device_type not in backend.device_types:
            raise ValueError(f"attention_backend: {name!r} does not run on {device_type}")
        return backend.fn
    candidates = [b for b in _BACKENDS.values() if device_type in b.device_types]
    if not candidates:
        raise ValueError(f"device: no attention backend for {device_type}")
    best = max(candidates, key=lambda b: b.priority)
    logger.debug("attention backend %s for %s", best.name, device_type)
    return best.fn


__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "get_attention_backend",
    "register_attention_backend",
    "torch_paged_attention",
]
