"""The model runner's one seam to the model: `ModelExecutor`, and the factory that picks it.

The runner owns the step's inputs and the KV cache tensors; an executor owns the model and runs it
over them. Two implementations:
- `LocalExecutor`: the whole model in this process.
- `TensorParallelExecutor` (`kvfleet.engine.distributed.executor`): rank 0's shard here, ranks
  1..N-1 in worker processes that it keeps in step (every call is mirrored to them first).
`build_executor` chooses from `EngineConfig.tensor_parallel_size`; nothing else in the runner
depends on which one it got.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional, Protocol

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.cuda_graphs import CudaGraphRunner, build_graph_runner
from kvfleet.engine.distributed.executor import start_tensor_parallel
from kvfleet.engine.kv_cache import block_pairs, copy_blocks
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_loader import load_model, quantize_loaded
from kvfleet.engine.models.base import CausalLM

logger = logging.getLogger(__name__)


class ModelExecutor(Protocol):
    """Runs the model for the model runner (one process, or rank 0 of a tensor-parallel group)."""

    model: CausalLM          # this process's model (rank 0's shard): read it, run it only through forward
    num_kv_heads: int        # KV heads this process holds: the cache is [2, blocks, block_size, num_kv_heads, head_dim]
    graphs: Optional[CudaGraphRunner]   # this process's decode CUDA graphs, once captured

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, logit_rows: Sequence[int] = (), *,
                eager: bool = False) -> torch.Tensor:
        """The step's final hidden states [T, hidden]: a captured graph's replay when one fits the step
        (unless `eager`), else the eager forward. `logit_rows`: the rows whose logits the
        caller computes next (`compute_logits(hidden[rows])`): tensor-parallel workers compute theirs
        with the step, so that call then waits for no message."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden rows [N, hidden] -> logits [N, vocab] in the model dtype."""
        ...

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block `dst` of every layer's cache becomes a copy of block `src`, per (src, dst)."""
        ...

    def capture_graphs(self, kv_caches: list[torch.Tensor], max_batch: int, max_model_len: int,
                       block_size: int, mixed_max_tokens: int = 0) -> None:
        """Capture decode CUDA graphs over these caches (CUDA only; sets `graphs`, or leaves it None
        where this executor runs decode eagerly), and steps with prefill of up to `mixed_max_tokens` tokens
        where the executor supports them (`kvfleet.engine.mixed_graphs`)."""
        ...

    def free_cache(self) -> None:
        """The runner dropped its KV cache (after profiling): helpers drop theirs."""
        ...

    def shutdown(self) -> None:
        """Release the graphs, then stop whatever the executor started. Idempotent."""
        ...


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.num_kv_heads = model.config.num_kv_heads
        self.graphs: Optional[CudaGraphRunner] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, logit_rows: Sequence[int] = (), *,
                eager: bool = False) -> torch.Tensor:
        graphs = self.graphs
        if graphs is not None and not eager and graphs.can_run(input_ids.shape[0], attn_metadata):
            return graphs.run(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        src, dst = block_pairs(pairs, self.device)
        copy_blocks(kv_caches, src, dst)

    def capture_graphs(self, kv_caches: list[torch.Tensor], max_batch: int, max_model_len: int,
                       block_size: int, mixed_max_tokens: int = 0) -> None:
        self.graphs = build_graph_runner(self.model, kv_caches, max_batch, max_model_len, block_size, self.device,
                                         mixed_max_tokens)

    def free_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None


def build_executor(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device) -> ModelExecutor:
    """The executor `engine_config` asks for, its model loaded (and quantized, if asked: each rank its own shards):
    at tensor_parallel_size N > 1 this process becomes rank 0 and N-1 worker processes start (see
    kvfleet.engine.distributed.executor)."""
    tp_size = engine_config.tensor_parallel_size
    if tp_size > 1:
        return start_tensor_parallel(model_config.model, tp_size, device.type, model_config.dtype,
                                     max_model_len=model_config.max_model_len,
                                     load_format=engine_config.load_format, seed=engine_config.seed,
                                     quantization=engine_config.quantization)
    model = load_model(model_config, device, load_format=engine_config.load_format, seed=engine_config.seed)
    quantize_loaded(model, engine_config.quantization)
    return LocalExecutor(model, device)
