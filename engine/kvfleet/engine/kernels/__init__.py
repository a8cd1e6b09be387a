"""Triton kernels of the engine, one per module, each with a plain-PyTorch reference.

Compiled on CUDA; under ``TRITON_INTERPRET=1`` they also run on CPU tensors (tests).
"""

import os as _os

import torch

from .activation import silu_and_mul, silu_mul, silu_mul_ref
from .paged_decode import choose_num_splits, paged_attention_ref, paged_decode_attention
from .prefill_attention import prefill_attention
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from .rms_norm import fused_add_rms_norm, rms_norm, rms_norm_ref
from .rotary import apply_rotary_cos_sin, build_cos_sin_cache, rope_inv_freq, rotary_embedding, rotary_embedding_ref

__all__ = [
    "apply_rotary_cos_sin", "build_cos_sin_cache", "choose_num_splits", "fused_add_rms_norm", "paged_attention_ref",
    "paged_decode_attention", "prefill_attention", "reshape_and_cache", "reshape_and_cache_ref",
    "fused_kernels_enabled", "rms_norm", "rms_norm_ref", "rope_inv_freq", "rotary_embedding", "rotary_embedding_ref",
    "silu_and_mul", "silu_mul", "silu_mul_ref",
]


# Registers the "triton" attention backend (preferred on CUDA) when the kernels are imported;
# kvfleet.engine.attention.get_attention_backend imports this package for that.
import kvfleet.engine.attention.triton_backend  # noqa: E402,F401


def fused_kernels_enabled(x: torch.Tensor) -> bool:
    """Whether model layers should use these kernels for ``x``: on CUDA, unless
    ``KVFLEET_FUSED_KERNELS=0`` (kept for A/B checks against the torch path)."""
    return x.is_cuda and _os.environ.get("KVFLEET_FUSED_KERNELS", "1") != "0"
