"""Engine configuration: `EngineConfig` holds every `LLM(...)` keyword argument, validated once.

What the engine knows about the model itself is `kvfleet.engine.model_config.ModelConfig`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp16", "bf16", "fp32")
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("fp8",)
# On CPU the KV pool is sized from this many bytes unless `num_kv_blocks` or
# `kv_cache_memory_bytes` says otherwise: enough for tests and the demo, small
# enough to never bother a laptop.
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024 * 1024


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {message}")


@dataclass
class EngineConfig:
    """Every `LLM(...)` keyword argument (vLLM names), checked by `validate()`."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_kv_blocks: Optional[int] = None
    seed: int = 0
    load_format: str = "auto"
    # Extras beyond the signature (vLLM has the same names).
    kv_cache_memory_bytes: Optional[int] = None
    enforce_eager: bool = False
    tokenizer: Optional[str] = None
    tensor_parallel_size: int = 1
    # Schedule and process outputs beside the device's step (kvfleet.engine.async_step). None = auto:
    # on for CUDA (measured on an H200: +3-50 % throughput, bench/NOTES.md), off on CPU, where the
    # forward runs on the host thread and there is nothing to overlap.
    async_scheduling: Optional[bool] = None
    # "fp8": bf16/fp16 weights quantized at load to float8_e4m3fn with a scale per output channel; activations
    # quantized per token at run time (kvfleet.engine.models.fp8; vLLM's `quantization="fp8"`). GPUs of compute
    # capability >= 8.9 only.
    quantization: Optional[str] = None

    def validate(self) -> "EngineConfig":
        _require(isinstance(self.model, (str, os.PathLike)) and str(self.model) != "",
                 "model", "must be a non-empty path or model id")
        _require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.device in _DEVICES or str(self.device).startswith("cuda:"),
                 "device", f"must be one of {_DEVICES} or 'cuda:N', got {self.device!r}")
        _require(isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
                 "block_size", f"must be a power of two in [1, 128], got {self.block_size!r}")
        _require(0.0 < float(self.gpu_memory_utilization) <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.max_model_len is None or int(self.max_model_len) >= 1, "max_model_len",
                 f"must be >= 1, got {self.max_model_len!r}")
        _require(int(self.max_num_seqs) >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs!r}")
        _require(self.max_num_batched_tokens is None or int(self.max_num_batched_tokens) >= 1,
                 "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens!r}")
        _require(self.num_kv_blocks is None or int(self.num_kv_blocks) >= 1, "num_kv_blocks",
                 f"must be >= 1, got {self.num_kv_blocks!r}")
        _require(self.kv_cache_memory_bytes is None or int(self.kv_cache_memory_bytes) >= 1,
                 "kv_cache_memory_bytes", f"must be >= 1, got {self.kv_cache_memory_bytes!r}")
        _require(self.load_format in _LOAD_FORMATS, "load_format",
                 f"must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        _require(isinstance(self.seed, int), "seed", f"must be an int, got {self.seed!r}")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", f"must be an int >= 1, got {self.tensor_parallel_size!r}")
        _require(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
                 f"must be a bool or None (auto), got {self.async_scheduling!r}")
        _require(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
                 f"must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        return self

    def resolve_batched_tokens(self, max_model_len: int, on_gpu: bool = False) -> int:
        """The per-step token budget: given, or a default (vLLM's offline 8192 on a GPU, 2048
        on CPU) that also fits any prompt when prefill cannot be chunked."""
        if self.max_num_batched_tokens is not None:
            budget = int(self.max_num_batched_tokens)
            if not self.enable_chunked_prefill:
                _require(budget >= max_model_len, "max_num_batched_tokens",
                         f"must be >= max_model_len ({max_model_len}) when chunked prefill is off, got {budget}")
            return budget
        default = 8192 if on_gpu else 2048
        if self.enable_chunked_prefill:
            return default
        return max(default, max_model_len)
