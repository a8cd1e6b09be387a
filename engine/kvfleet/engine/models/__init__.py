"""Our own PyTorch model code (transformers is never used for the forward pass)."""

from kvfleet.engine.models.base import CausalLM
from kvfleet.engine.models.llama import LlamaForCausalLM
from kvfleet.engine.models.registry import MODEL_REGISTRY, get_model_class

__all__ = ["CausalLM", "LlamaForCausalLM", "MODEL_REGISTRY", "get_model_class"]
