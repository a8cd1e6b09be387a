"""Engine and model configuration.

`EngineConfig` holds every `LLM(...)` keyword argument, validated once; `ModelConfig`
is what the engine needs to know about the model, read from a Hugging Face config
(a model folder, a GGUF file, or a hub id where the machine has network).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp16", "bf16", "fp32")
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
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
        return self

    def resolve_batched_tokens(self, max_model_len: int) -> int:
        """The per-step token budget: given, or a default that fits any prompt when
        prefill cannot be chunked."""
        if self.max_num_batched_tokens is not None:
            budget = int(self.max_num_batched_tokens)
            if not self.enable_chunked_prefill:
                _require(budget >= max_model_len, "max_num_batched_tokens",
                         f"must be >= max_model_len ({max_model_len}) when chunked prefill is off, got {budget}")
            return budget
        if self.enable_chunked_prefill:
            return 2048
        return max(2048, max_model_len)


@dataclass
class ModelConfig:
    """What the engine needs to know about the model, from its HF config."""

    model: str                      # what the user passed
    model_dir: str                  # folder holding config / weights (or the hub id)
    gguf_file: Optional[str]        # file name inside model_dir when the model is one GGUF file
    hf_config: Any                  # transformers.PretrainedConfig
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_model_len: int
    dtype: str                      # resolved torch dtype name: "float32" | "float16" | "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers


def resolve_model_path(model: str) -> tuple[str, Optional[str]]:
    """(folder or hub id, gguf file name or None) for a folder, a .gguf file, or a
    folder that holds exactly one .gguf file and no config.json."""
    path = Path(model).expanduser()
    if path.is_file():
        _require(path.suffix == ".gguf", "model", f"a file must be a .gguf file, got {model!r}")
        return str(path.parent.resolve()), path.name
    if path.is_dir():
        if (path / "config.json").exists():
            return str(path.resolve()), None
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        _require(len(ggufs) == 1, "model",
                 f"folder {model!r} has no config.json and {len(ggufs)} .gguf files (need exactly one)")
        return str(path.resolve()), ggufs[0]
    _require(not str(model).startswith(("/", ".", "~")), "model", f"path {model!r} does not exist")
    return str(model), None  # a hub id; transformers fetches it where there is network


# GGUF configs carry a model_type but no `architectures`.
_ARCH_BY_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _resolve_dtype(requested: str, hf_config: Any, device: str) -> str:
    aliases = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
    requested = aliases.get(requested, requested)
    if requested != "auto":
        return requested
    if device == "cpu":
        return "float32"  # CPU half-precision matmuls are slow and less exact
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(cfg).replace("torch.", "") if cfg is not None else "bfloat16"
    return name if name in ("float16", "bfloat16") else "bfloat16"


def _eos_ids(hf_config: Any) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def load_model_config(engine_config: EngineConfig, device: str) -> ModelConfig:
    """Read the HF config of `engine_config.model` and derive the engine's view of it."""
    from transformers import AutoConfig  # heavy import, only when a model is really loaded

    model_dir, gguf_file = resolve_model_path(str(engine_config.model))
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    hf_config = AutoConfig.from_pretrained(model_dir, **kwargs)
    text_cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text_cfg.num_attention_heads)
    kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads)
    derived_len = int(getattr(text_cfg, "max_position_embeddings", 0) or 2048)
    max_len = derived_len
    if engine_config.max_model_len is not None:
        max_len = int(engine_config.max_model_len)
        if max_len > derived_len:
            logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d",
                           max_len, derived_len)
    archs = getattr(hf_config, "architectures", None) or [_ARCH_BY_TYPE.get(
        hf_config.model_type, f"{hf_config.model_type.capitalize()}ForCausalLM")]
    return ModelConfig(
        model=str(engine_config.model),
        model_dir=model_dir,
        gguf_file=gguf_file,
        hf_config=text_cfg,
        architecture=str(archs[0]),
        vocab_size=int(text_cfg.vocab_size),
        hidden_size=int(text_cfg.hidden_size),
        num_hidden_layers=int(text_cfg.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_model_len=max_len,
        dtype=_resolve_dtype(engine_config.dtype, text_cfg, device),
        eos_token_ids=_eos_ids(text_cfg),
    )
