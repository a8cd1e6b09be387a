"""Triton kernels of the engine, one per module, each with a plain-PyTorch reference.

Compiled on CUDA; under ``TRITON_INTERPRET=1`` they also run on CPU tensors (tests).
A leaf package: the kernels import torch and triton only. Their users (the model layers,
the attention backend) decide when to call them.
"""

from .activation import silu_and_mul, silu_and_mul_quant_fp8, silu_mul, silu_mul_ref
from .fp8_quant import QuantizedActivation
from .paged_decode import choose_num_splits, paged_attention_ref, paged_decode_attention
from .prefill_attention import prefill_attention
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from .rms_norm import fused_add_rms_norm, fused_add_rms_norm_quant_fp8, rms_norm, rms_norm_quant_fp8, rms_norm_ref
from .rotary import apply_rotary_cos_sin, build_cos_sin_cache, rope_tables, rotary_embedding, rotary_embedding_ref

__all__ = [
    "QuantizedActivation", "apply_rotary_cos_sin", "build_cos_sin_cache", "choose_num_splits", "fused_add_rms_norm",
    "fused_add_rms_norm_quant_fp8", "paged_attention_ref", "paged_decode_attention", "prefill_attention",
    "reshape_and_cache", "reshape_and_cache_ref", "rms_norm", "rms_norm_quant_fp8", "rms_norm_ref", "rope_tables",
    "rotary_embedding", "rotary_embedding_ref", "silu_and_mul", "silu_and_mul_quant_fp8", "silu_mul", "silu_mul_ref",
]
