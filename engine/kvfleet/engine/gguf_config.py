"""The transformers config of a GGUF model, from `gguf_file`'s one pass over the header.

transformers builds a GGUF model's config in `load_gguf_checkpoint`, through gguf-py's slow reader (~4 s for
the default model). For the architectures we serve this applies the same rules to the metadata we already
read: transformers' own key table (`GGUF_CONFIG_MAPPING`) and defaults, its "mistral" rename of a llama file,
tied embeddings where the file has no `output.weight`, and the vocabulary's length where no vocab_size is given.
A test holds the result equal to transformers'
for each of them.
"""

from __future__ import annotations

from typing import Any, cast

from kvfleet.engine.gguf_file import GGUFContents

# transformers' names of the GGUF architectures we serve; any other goes through transformers itself
_SERVED = ("llama", "mistral", "qwen2", "qwen3")


def config_dict(contents: GGUFContents) -> dict[str, Any] | None:
    """transformers' config dict for this file, or None where its architecture is not one we serve."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = contents.architecture
    # transformers compares the list of general.name's values with "mistral": only that exact name renames
    is_mistral = "llama" in architecture and contents.metadata.get("general.name") == "mistral"
    renamed = "mistral" if is_mistral else architecture
    if renamed not in _SERVED:
        return None
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in contents.tensor_names()}
    defaults: dict[str, Any] = GGUF_CONFIG_DEFAULTS_MAPPING.get(
        renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, default in defaults.items():
        config.setdefault(key, default)
    table = cast(dict[str, dict[str, Any]], GGUF_CONFIG_MAPPING)   # prefix -> GGUF key -> config key
    for gguf_key, value in contents.metadata.items():
        prefix, _, config_key = gguf_key.replace(architecture, renamed).partition(".")
        target = table.get(prefix, {}).get(config_key)
        if target is None or target == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]   # transformers keeps one-element arrays as their element
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, renamed)
        config[target] = value
    tokens = contents.metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):   # as transformers: the vocabulary's length
        config["vocab_size"] = len(tokens)
    return config


def hf_config(contents: GGUFContents, name_or_path: str) -> Any | None:
    """The config object `AutoConfig.from_pretrained(folder, gguf_file=...)` builds for this file, or None (see
    `config_dict`); `name_or_path` is the folder as the caller named it."""
    from transformers import AutoConfig

    values = config_dict(contents)
    if values is None:
        return None
    return AutoConfig.for_model(**values, name_or_path=name_or_path)
