"""What the engine needs to know about a model, read from an HF folder or a GGUF file.

transformers is used here only to parse config.json / GGUF metadata (offline); the
forward pass is ours (`kvfleet.engine.models`).

dtype policy ("auto"): the dtype the checkpoint declares, except that half types
(bfloat16/float16) become float32 on CPU — CPU half matmuls are slow and we want
CPU results to match transformers' float32 reference exactly. A checkpoint that
declares nothing gets float32.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.gguf_config import hf_config
from kvfleet.engine.gguf_file import read_gguf

logger = logging.getLogger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype name or torch.dtype -> torch.dtype; None/"auto" -> None. Bad names raise ValueError."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        if value not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype: {value} is not supported (use float32, bfloat16 or float16)")
        return value
    name = str(value).lower().removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype: {value!r} is not one of auto, {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def resolve_dtype(requested: str | torch.dtype | None, config_dtype: Any, device: str | torch.device) -> torch.dtype:
    """Pure decision: the dtype weights and KV cache get (see the module docstring)."""
    explicit = parse_dtype(requested)
    if explicit is not None:
        return explicit
    try:
        declared = parse_dtype(config_dtype) if config_dtype is not None else None
    except ValueError:
        declared = None
    if declared is None:
        return torch.float32
    if torch.device(device).type == "cpu" and declared in (torch.bfloat16, torch.float16):
        return torch.float32
    return declared


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# What a hub download fetches: configs, safetensors weights, tokenizer files and chat templates.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def split_model_path(path_or_gguf: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """-> (local folder, gguf file name or None) for a folder, a .gguf file, or a hub id
    ("org/name", downloaded where the machine has network). Raises ValueError naming `model`."""
    path = Path(path_or_gguf).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0].name
        raise ValueError(f"model: {path} has no config.json (and not exactly one .gguf file)")
    name = str(path_or_gguf)
    if _HUB_ID.fullmatch(name) and not path.exists():
        return _download_from_hub(name), None
    raise ValueError(f"model: {name!r} is neither a model folder nor a .gguf file")


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated model...
        raise ValueError(
            f"model: {repo_id!r} is no local folder or .gguf file, and the hub could not provide it "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from None


def _eos_ids(hf_config: Any, folder: Path) -> list[int]:
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        import json

        add(json.loads(gen_file.read_text()).get("eos_token_id"))
    return ids


@dataclass
class ModelConfig:
    model: str                      # what the user passed (folder or .gguf path)
    folder: Path
    gguf_file: str | None
    model_type: str                 # llama | mistral | qwen2 | qwen3
    architecture: str               # e.g. LlamaForCausalLM
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_model_len: int
    eos_token_ids: list[int]
    dtype: torch.dtype
    hf_config: Any = field(repr=False, default=None)

    @property
    def gguf_path(self) -> Path | None:
        return self.folder / self.gguf_file if self.gguf_file else None

    @classmethod
    def from_pretrained(
        cls,
        path_or_gguf: str | os.PathLike[str],
        max_model_len: int | None = None,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = None,
    ) -> "ModelConfig":
        from transformers import AutoConfig

        folder, gguf_file = split_model_path(path_or_gguf)
        # a GGUF of an architecture we serve: its config from our one pass over the header (gguf_config says why)
        hf = hf_config(read_gguf(folder / gguf_file), str(folder)) if gguf_file else None
        if hf is None:
            kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            hf = AutoConfig.from_pretrained(str(folder), local_files_only=True, **kwargs)
        return cls.from_hf_config(hf, str(path_or_gguf), folder, gguf_file, max_model_len, dtype, device)

    @classmethod
    def from_hf_config(
        cls,
        hf: Any,
        model: str,
        folder: Path,
        gguf_file: str | None = None,
        max_model_len: int | None = None,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = None,
    ) -> "ModelConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: architecture {model_type!r} is not supported "
                             f"({', '.join(SUPPORTED_MODEL_TYPES)})")
        archs = getattr(hf, "architectures", None) or [type(hf).__name__.replace("Config", "ForCausalLM")]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (default, llama3, linear)")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        derived = _derived_max_len(hf)
        if max_model_len is None:
            max_model_len = derived
        elif max_model_len < 1 or max_model_len > derived:
            raise ValueError(f"max_model_len: {max_model_len} must be in [1, {derived}] for this model")
        dev = device if device is not None else default_device()
        return cls(
            model=model,
            folder=folder,
            gguf_file=gguf_file,
            model_type=model_type,
            architecture=archs[0],
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            rms_norm_eps=float(hf.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_model_len=max_model_len,
            eos_token_ids=_eos_ids(hf, folder),
            dtype=resolve_dtype(dtype, getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None), dev),
            hf_config=hf,
        )


def _derived_max_len(hf: Any) -> int:
    """The longest context the model supports; a sliding window caps it (we only do full attention)."""
    length = int(getattr(hf, "max_position_embeddings", 2048))
    window = getattr(hf, "sliding_window", None)
    uses_window = getattr(hf, "use_sliding_window", True)
    if window and uses_window and window < length:
        logger.info("max_model_len capped to sliding_window=%d (full attention only)", window)
        length = int(window)
    return length
