"""`CausalLM`: what every model class of the registry is, for the loader and the executors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvfleet.engine.attention import AttentionFn
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.model_config import ModelConfig


class CausalLM(nn.Module):
    """A decoder over a paged KV cache. Built on the target device in the target dtype (the loader
    sets both as defaults); under tensor parallelism it holds this rank's shard of every layer."""

    config: ModelConfig
    attention_fn: AttentionFn   # the attention backend every layer calls (captured steps depend on which)

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """The step's flat tokens [T] -> final hidden states [T, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype (whole, on every rank)."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy in HF-named checkpoint tensors (or lazy slices: each layer reads only this rank's
        shard); -> the checkpoint names loaded."""
        raise NotImplementedError

    def expected_weights(self) -> set[str]:
        """The checkpoint names a complete checkpoint provides."""
        raise NotImplementedError
