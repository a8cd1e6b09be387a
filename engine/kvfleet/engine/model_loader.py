"""Build one model (this process's shard of it) on the device and fill its weights: safetensors, GGUF, or dummy.

Tensors stream one at a time (safetensors through lazy slices, so a
tensor-parallel rank reads only its shard) straight into parameters that were
allocated on the device in the target dtype; a tqdm bar on stderr shows progress
when stderr is a terminal. Which processes load which shard is the executors' business
(`kvfleet.engine.model_executor`, `kvfleet.engine.distributed`): this module starts nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.models.base import CausalLM
from kvfleet.engine.models.registry import get_model_class
from kvfleet.engine.models.small_m_linear import small_m_gemm_settings
from kvfleet.engine.progress import progress_bar

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_load_format(cfg: ModelConfig, load_format: str) -> str:
    """Pure decision: which loader reads this model."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if load_format != "auto":
        if load_format == "gguf" and cfg.gguf_file is None:
            raise ValueError("load_format: 'gguf' needs a .gguf model file")
        return load_format
    if cfg.gguf_file is not None:
        return "gguf"
    if any(cfg.folder.glob("*.safetensors")):
        return "safetensors"
    raise ValueError(f"model: no *.safetensors or .gguf weights in {cfg.folder} (use load_format='dummy'?)")


def iter_safetensors(folder: Path, quiet: bool | None = None) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor of every *.safetensors file in the folder."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with progress_bar(total, "Loading safetensors", quiet) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_slice(name)
                bar.update(1)


def _load_dummy(model: CausalLM, seed: int) -> None:
    """Random weights of the right shapes, drawn on the device: std 0.02 matrices, norms at 1, biases 0."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                param.normal_(0.0, 0.02, generator=generators[param.device])


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    *,
    load_format: str = "auto",
    seed: int = 0,
    quiet: bool | None = None,
) -> CausalLM:
    """-> `model_config`'s model on `device` in `model_config.dtype`, weights loaded, eval mode, no grad.

    `load_format`: "auto" (a .gguf model file, else *.safetensors), "safetensors", "gguf" or "dummy"
    (random weights from `seed`); `quiet`: True/False forces the progress bar off/on (default: on
    when stderr is a terminal). In a process that has joined a tensor-parallel group
    (`kvfleet.engine.distributed.init_tensor_parallel`), the layers shard themselves and only this
    rank's part of every tensor is read.
    """
    device = torch.device(device)
    small_m_gemm_settings()   # a bad KVFLEET_SMALL_M_GEMM_MAX fails here, not at the first forward
    fmt = resolve_load_format(model_config, load_format)
    cls = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = cls(model_config, device=device)
    if fmt == "dummy":
        _load_dummy(model, seed)
    else:
        if fmt == "gguf":
            from kvfleet.engine.gguf_loader import iter_gguf_tensors

            weights: Iterator[tuple[str, Any]] = iter_gguf_tensors(model_config, quiet)
        else:
            weights = iter_safetensors(model_config.folder, quiet)
        with torch.no_grad():
            loaded = model.load_weights(weights)
        missing = model.expected_weights() - loaded
        if missing:
            raise ValueError(f"weights: the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    logger.info("loaded %s (%s) on %s as %s", model_config.architecture, fmt, device, model_config.dtype)
    return model.eval().requires_grad_(False)


def quantize_loaded(model: CausalLM, quantization: str | None) -> None:
    """Put a loaded model's weights in their serving form: `"fp8"` quantizes every decoder linear layer (of this
    rank's shards, under tensor parallelism: each rank its own; kvfleet.engine.models.fp8), None leaves them."""
    if quantization is None:
        return
    if quantization != "fp8":
        raise ValueError(f"quantization: {quantization!r} is not supported (fp8 or none)")
    from kvfleet.engine.models.fp8 import quantize_model_fp8

    n = quantize_model_fp8(model)
    logger.info("fp8: %d linear layers quantized (per-channel weight scales, dynamic per-token activations)", n)
