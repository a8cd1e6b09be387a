"""A tensor-parallel worker process (ranks 1..N-1): holds its shards and KV cache, mirrors the driver.

The driver (rank 0, inside the engine) broadcasts one control message per call on
the model; the worker runs the same call on its shards so the collectives inside
the forward pair up. Messages: ("forward", ids, positions, metadata, cache_shape),
("logits", rows_shape), ("copy_blocks", src, dst), ("shutdown",).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.distributed.parallel_state import broadcast_object, destroy_tensor_parallel, init_tensor_parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard of the model (picklable)."""

    model: str
    max_model_len: int | None
    dtype: torch.dtype
    load_format: str
    seed: int
    device_type: str          # "cpu" | "cuda"
    tp_size: int
    init_method: str          # tcp://127.0.0.1:PORT
    timeout_s: float = 300.0


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def metadata_to(md: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return replace(
        md,
        slot_mapping=md.slot_mapping.to(device),
        query_start_loc=md.query_start_loc.to(device),
        seq_lens=md.seq_lens.to(device),
        block_tables=md.block_tables.to(device),
    )


def build_shard(spec: WorkerSpec, rank: int) -> tuple[torch.nn.Module, torch.device]:
    """Join the group as `rank` and load this rank's shards (only those are read from disk)."""
    from kvfleet.engine.model_config import ModelConfig
    from kvfleet.engine.model_loader import load_model

    device = rank_device(spec.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, spec.tp_size, spec.init_method, device=device, timeout_s=spec.timeout_s)
    cfg = ModelConfig.from_pretrained(spec.model, spec.max_model_len, spec.dtype, device)
    model = load_model(cfg, device=device, dtype=spec.dtype, load_format=spec.load_format, quiet=True,
                       seed=spec.seed)
    return model, device


class ShardWorker:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.kv_caches: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None

    def _ensure_cache(self, shape: tuple[int, ...], num_layers: int) -> None:
        if not self.kv_caches or tuple(self.kv_caches[0].shape) != tuple(shape):
            self.kv_caches = []  # free the old pool before taking the new one
            self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    def handle(self, msg: tuple[Any, ...]) -> bool:
        """Run one driver call; False on shutdown."""
        cmd = msg[0]
        if cmd == "forward":
            _, ids, positions, md, cache_shape, num_layers = msg
            self._ensure_cache(cache_shape, num_layers)
            self.hidden = self.model(ids.to(self.device), positions.to(self.device), self.kv_caches,
                                     metadata_to(md, self.device))
        elif cmd == "logits":
            rows = torch.empty(msg[1], dtype=self.dtype, device=self.device)
            dist.broadcast(rows, src=0)
            self.model.compute_logits(rows)
        elif cmd == "copy_blocks":
            src, dst = msg[1].to(self.device), msg[2].to(self.device)
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
        elif cmd == "free_cache":
            self.kv_caches = []
        elif cmd == "shutdown":
            return False
        else:
            raise ValueError(f"tensor parallel worker: unknown command {cmd!r}")
        return True

    @torch.inference_mode()
    def serve(self) -> None:
        while self.handle(broadcast_object()):
            pass


def _exit_when_orphaned(parent: int) -> None:
    """The driver died without telling us: leave instead of waiting in a collective forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(rank: int, spec: WorkerSpec, parent_pid: int) -> None:
    """Entry point of a spawned worker process."""
    logging.basicConfig(level=os.environ.get("KVFLEET_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    model, device = build_shard(spec, rank)
    try:
        ShardWorker(model, device, spec.dtype).serve()
    finally:
        destroy_tensor_parallel()
