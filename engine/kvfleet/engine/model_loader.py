"""Build our model on the device and fill its weights: safetensors, GGUF, or dummy.

Tensors stream one at a time (safetensors through lazy slices, so a
tensor-parallel rank reads only its shard) straight into parameters that were
allocated on the device in the target dtype; a tqdm bar on stderr shows progress
when stderr is a terminal.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvfleet.engine.model_config import ModelConfig, parse_dtype
from kvfleet.engine.models.registry import get_model_class

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


def _progress(total: int, desc: str, quiet: bool | None) -> Any:
    from tqdm.auto import tqdm

    disable = quiet if quiet is not None else not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=disable, leave=False)


def as_model_config(config: Any, device: str | torch.device) -> ModelConfig:
    """Accept our ModelConfig or the engine's `kvfleet.engine.config.ModelConfig` (duck-typed:
    hf_config, model, model_dir, gguf_file, max_model_len, dtype) and return ours."""
    if isinstance(config, ModelConfig):
        return config
    try:
        hf, model, folder = config.hf_config, config.model, Path(config.model_dir)
    except AttributeError as exc:
        raise ValueError(f"model_config: {type(config).__name__} is not a model config ({exc})") from None
    ours = ModelConfig.from_hf_config(
        hf, str(model), folder, getattr(config, "gguf_file", None), None, getattr(config, "dtype", "auto"), device
    )
    if getattr(config, "max_model_len", None):
        ours.max_model_len = int(config.max_model_len)
    return ours


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
    with _progress(total, "Loading safetensors", quiet) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_slice(name)
                bar.update(1)


def _load_dummy(model: nn.Module, seed: int) -> None:
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
    engine_config: Any = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    load_format: str | None = None,
    quiet: bool | None = None,
    seed: int = 0,
) -> nn.Module:
    """-> our model (eval mode, no grad) on `device` in `dtype`.

    `engine_config` (optional) supplies `load_format`/`seed` when those are not given;
    `load_model(cfg, "cpu", torch.float32)` is accepted too (device in second place).
    """
    if isinstance(engine_config, (str, torch.device)):
        engine_config, device, dtype = None, engine_config, device if dtype is None else dtype
    if load_format is None:
        load_format = getattr(engine_config, "load_format", None) or "auto"
    seed = getattr(engine_config, "seed", seed) if engine_config is not None else seed
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model_config = as_model_config(model_config, device)
    target = parse_dtype(dtype) or model_config.dtype
    tp_size = int(getattr(engine_config, "tensor_parallel_size", 1) or 1)
    if tp_size > 1:  # rank 0 here, the other ranks in worker processes (kvfleet.engine.distributed)
        from kvfleet.engine.distributed.executor import start_tensor_parallel

        return start_tensor_parallel(  # type: ignore[return-value]
            model_config.model, tp_size, device.type, target, max_model_len=model_config.max_model_len,
            load_format=load_format, seed=seed,
        )
    fmt = resolve_load_format(model_config, load_format)
    cls = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(target):
        model = cls(model_config, device=device)
    if fmt == "dummy":
        _load_dummy(model, seed)
    else:
        if fmt == "gguf":
            from kvfleet.engine.gguf_loader import iter_gguf_tensors

            weights = iter_gguf_tensors(model_config, quiet)
        else:
            weights = iter_safetensors(model_config.folder, quiet)
        with torch.no_grad():
            loaded = model.load_weights(weights)  # type: ignore[operator]
        missing = model.expected_weights() - loaded  # type: ignore[operator]
        if missing:
            raise ValueError(f"weights: the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    logger.info("loaded %s (%s) on %s as %s", model_config.architecture, fmt, device, target)
    return model.eval().requires_grad_(False)
