"""Tensor parallelism: the process group the model layers shard over."""

from kvfleet.engine.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    tp_all_gather,
    tp_all_reduce,
)

__all__ = [
    "destroy_tensor_parallel",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "tp_all_gather",
    "tp_all_reduce",
]
