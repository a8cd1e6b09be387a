"""GGUF weights -> (HF tensor name, dequantized tensor), for our model's `load_weights`.

Names map through gguf-py's own table (HF name -> GGUF name, reversed), as
transformers' GGUF loader does. llama.cpp's converter permutes the rows of Q and K
of `llama`-architecture files for its interleaved rope; we undo it exactly as
transformers' `LlamaTensorProcessor._reverse_permute_weights` does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from kvfleet.engine.gguf_file import read_gguf, tensor_data
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.progress import progress_bar

logger = logging.getLogger(__name__)

_LAYER_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "post_attention_layernorm",
)


def hf_names(num_layers: int) -> list[str]:
    """Module names (without .weight/.bias) a Llama-family HF checkpoint may hold."""
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{part}" for part in _LAYER_PARTS]
    return names


def gguf_to_hf_map(arch_name: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name (with suffix) -> HF name, via gguf-py's tensor name table."""
    import gguf

    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise ValueError(f"model: GGUF architecture {arch_name!r} is unknown to gguf-py")
    table = gguf.get_tensor_name_map(arch, num_layers)
    mapping: dict[str, str] = {}
    for hf in hf_names(num_layers):
        name = table.get_name(hf)
        if name is not None:
            for suffix in (".weight", ".bias"):
                mapping[name + suffix] = hf + suffix
    return mapping


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of Q/K rows (n_head = heads of that projection)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def iter_gguf_tensors(cfg: ModelConfig, quiet: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor of cfg.gguf_path (float32 on the host, one at a time)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if cfg.gguf_path is None:
        raise ValueError("model: not a GGUF model")
    contents = read_gguf(cfg.gguf_path)
    arch_name = contents.architecture
    mapping = gguf_to_hf_map(arch_name, cfg.num_layers)
    permute = arch_name == "llama"
    with progress_bar(len(contents.tensors), "Loading GGUF", quiet) as bar:
        for tensor in contents.tensors:
            bar.update(1)
            name = mapping.get(tensor.name)
            if name is None:
                logger.debug("skipping GGUF tensor %s", tensor.name)
                continue
            weights = dequantize(tensor_data(contents, tensor), GGMLQuantizationType(tensor.ggml_type))
            if permute and ".attn_q." in tensor.name:
                weights = reverse_permute(weights, cfg.num_heads)
            elif permute and ".attn_k." in tensor.name:
                weights = reverse_permute(weights, cfg.num_kv_heads)
            # A copy: the file is mapped read-only.
            yield name, torch.from_numpy(np.array(weights, dtype=np.float32))
