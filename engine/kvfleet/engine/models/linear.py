"""Linear and embedding layers that can be sharded for tensor parallelism (Megatron style).

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes
the FULL checkpoint tensor — a torch.Tensor or a lazy safetensors slice (anything
with `.shape`/`get_shape()` and `[a:b]` indexing) — and copies in only this rank's
part, so a rank reads only its own shard from disk. At tp_size 1 they are plain layers.

Their products (and the LM head's) go through ``small_m_linear.linear``: ``F.linear``, or on CUDA, for a step of a
few rows (``KVFLEET_SMALL_M_GEMM_MAX``, default 1: batch-1 decode on CUDA), the Triton small-M GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.engine.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from kvfleet.engine.models.small_m_linear import linear


def full_shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.shape) if hasattr(loaded, "shape") else tuple(loaded.get_shape())


def _materialize(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def _narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows/columns [start, start+length) of a tensor or lazy slice, read from disk only for that range."""
    if dim == 0:
        return _materialize(loaded[start : start + length])
    return _materialize(loaded[:, start : start + length])


def _check(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ValueError(f"weights: {name} has shape {got}, the model expects {expected}")


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    _check("tensor", full_shape(loaded), tuple(param.shape))
    param.data.copy_(_materialize(loaded))


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; several logical outputs may be fused
    (e.g. gate|up), each split separately so every rank holds a slice of each."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        for size in output_sizes:
            if size % self.tp_size:
                raise ValueError(f"tensor_parallel_size: output size {size} is not divisible by {self.tp_size}")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.local_sizes = [s // self.tp_size for s in output_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """-> (offset in the local param, start in the full tensor, length) of logical output `shard_id`."""
        offset = sum(self.local_sizes[:shard_id])
        length = self.local_sizes[shard_id]
        return offset, self.tp_rank * length, length

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        index = 0 if shard_id is None else int(shard_id)
        if shard_id is None and len(self.output_sizes) != 1:
            raise ValueError("weights: a fused layer needs a shard id")
        offset, start, length = self.shard_range(index)
        shape = full_shape(loaded)
        expected = (self.output_sizes[index],) + tuple(param.shape[1:])
        _check(f"output {index}", shape, expected)
        param.data[offset : offset + length].copy_(_narrow(loaded, 0, start, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection; query heads split across ranks, KV heads split too, or
    replicated (each rank keeps one) when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        tp_size = get_tp_size() if tp_size is None else tp_size
        if num_heads % tp_size:
            raise ValueError(f"tensor_parallel_size: {num_heads} attention heads not divisible by {tp_size}")
        if num_kv_heads >= tp_size and num_kv_heads % tp_size:
            raise ValueError(f"tensor_parallel_size: {num_kv_heads} KV heads not divisible by {tp_size}")
        if num_kv_heads < tp_size and tp_size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size: {tp_size} is not a multiple of {num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.num_heads_local = num_heads // tp_size
        self.num_kv_heads_local = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        kv_out = self.num_kv_heads_local * head_dim * tp_size  # logical size as if split evenly
        super().__init__(hidden_size, [num_heads * head_dim, kv_out, kv_out], bias, tp_rank, tp_size)
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        index = {"q": 0, "k": 1, "v": 2}.get(shard_id, None)
        if index is None:
            raise ValueError(f"weights: qkv shard id must be q, k or v, got {shard_id!r}")
        offset, length = sum(self.local_sizes[:index]), self.local_sizes[index]
        _check(f"{shard_id}_proj", full_shape(loaded), (self.full_sizes[index],) + tuple(param.shape[1:]))
        if index == 0:
            start = self.tp_rank * length
        else:  # rank r holds KV head(s) starting at (r // replicas) * local heads
            start = (self.tp_rank // self.kv_replicas) * length
        param.data[offset : offset + length].copy_(_narrow(loaded, 0, start, length))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if input_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size: input size {input_size} is not divisible by {self.tp_size}")
        self.input_size, self.output_size = input_size, output_size
        self.local_input = input_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, self.local_input), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:  # applied once, after the reduction
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _check("row-parallel weight", full_shape(loaded), (self.output_size, self.input_size))
        param.data.copy_(_narrow(loaded, 1, self.tp_rank * self.local_input, self.local_input))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (vocabulary padded to a multiple of tp_size);
    the LM head uses the same layout (`ParallelLMHead`)."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.local_vocab = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        _check("embedding", full_shape(loaded), (self.vocab_size, self.hidden_size))
        rows = max(0, min(self.local_vocab, self.vocab_size - self.vocab_start))
        param.data.zero_()
        if rows:
            param.data[:rows].copy_(_narrow(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] in the model dtype (gathered from every rank's vocab shard). Not cast
        to float32 here: a greedy step's argmax reads them as they are, and the sampler makes its own float32 copy
        where it needs one (issue 16, lease 24: the cast was a 71 us copy of every decode step)."""
        logits = linear(hidden, self.weight)
        return tp_all_gather(logits, dim=-1)[:, : self.vocab_size]
