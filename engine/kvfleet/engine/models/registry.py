"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from kvfleet.engine.models.base import CausalLM
from kvfleet.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"model: architecture {architecture!r} is not supported ({', '.join(MODEL_REGISTRY)})")
    return MODEL_REGISTRY[architecture]
