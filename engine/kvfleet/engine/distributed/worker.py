"""A tensor-parallel worker process (ranks 1..N-1): holds its shards and KV cache, mirrors the driver.

The driver (rank 0, inside the engine) sends one control message per call on
the model; the worker runs the same call on its shards so the collectives inside
the forward pair up. Control messages (small, host-only, through a pipe: control.py):
a `StepHeader` per forward (eager, or the replay of a captured decode graph; a header with
`logit_rows` also has the worker compute those rows' logits right after, as the driver will),
`CaptureGraphs`, `ComputeLogits`, `CopyBlocks`, `FreeCache`, `Shutdown`. The step's tensors follow
a header as one packed int64 tensor broadcast over the tensor group (NCCL on GPUs), so the driver
never waits for the device to build a message.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.cuda_graphs import CudaGraphRunner
from kvfleet.engine.distributed.control import (
    CaptureGraphs,
    ComputeLogits,
    CopyBlocks,
    FreeCache,
    Message,
    Shutdown,
    StepHeader,
    receive,
)
from kvfleet.engine.distributed.parallel_state import arm_hang_dump, destroy_tensor_parallel, init_tensor_parallel
from kvfleet.engine.kv_cache import allocate_kv_cache, copy_blocks
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_loader import load_model, quantize_loaded
from kvfleet.engine.models.base import CausalLM

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
    quantization: str | None = None   # "fp8": each rank quantizes its own shards at load


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    """ids | positions | slot_mapping | query_start_loc | seq_lens | block_tables, as one int64 tensor."""
    parts = [input_ids, positions, md.slot_mapping, md.query_start_loc, md.seq_lens, md.block_tables.flatten()]
    return torch.cat([p.to(torch.int64) for p in parts])


def unpack_step(packed: torch.Tensor, h: StepHeader) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    t, b = h.num_tokens, h.num_seqs
    ids, pos, slots, qsl, lens, tables = packed.split([t, t, t, b + 1, b, b * h.table_width])
    md = AttentionMetadata(
        slot_mapping=slots, query_start_loc=qsl.to(torch.int32), seq_lens=lens.to(torch.int32),
        block_tables=tables.view(b, h.table_width).to(torch.int32), max_query_len=h.max_query_len,
        max_seq_len=h.max_seq_len, query_start_loc_cpu=h.query_start_loc_cpu, seq_lens_cpu=h.seq_lens_cpu,
    )
    return ids, pos, md


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def build_shard(spec: WorkerSpec, rank: int) -> tuple[CausalLM, torch.device]:
    """Join the group as `rank` and load this rank's shards (only those are read from disk)."""
    device = rank_device(spec.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(rank, spec.tp_size, spec.init_method, device=device, timeout_s=spec.timeout_s)
    cfg = ModelConfig.from_pretrained(spec.model, spec.max_model_len, spec.dtype, device)
    model = load_model(cfg, device, load_format=spec.load_format, seed=spec.seed, quiet=True)
    quantize_loaded(model, spec.quantization)
    return model, device


class ShardWorker:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.kv_caches: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None
        self.graphs: CudaGraphRunner | None = None  # over this rank's shard and cache, once captured

    def _ensure_cache(self, shape: tuple[int, ...], num_layers: int) -> None:
        if not self.kv_caches or tuple(self.kv_caches[0].shape) != tuple(shape):
            self.graphs = None   # they read the old cache
            self.kv_caches = []  # free the old pool before taking the new one
            self.kv_caches = allocate_kv_cache(num_layers, shape, self.dtype, self.device)

    def _receive_step(self, header: StepHeader) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        packed = torch.empty(header.packed_len, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0)
        self._ensure_cache(header.cache_shape, header.num_layers)
        return unpack_step(packed, header)

    def handle(self, msg: Message) -> bool:
        """Run one driver call; False on shutdown."""
        if isinstance(msg, StepHeader):   # first: one per step
            ids, positions, md = self._receive_step(msg)
            if not msg.replay:
                self.hidden = self.model(ids, positions, self.kv_caches, md)
            elif self.graphs is None:
                raise RuntimeError("tensor parallel worker: asked to replay a CUDA graph it has not captured")
            else:
                self.hidden = self.graphs.run(ids, positions, self.kv_caches, md)
            if msg.logit_rows:  # the driver's compute_logits of these rows pairs with this one
                rows = torch.tensor(msg.logit_rows, dtype=torch.long).to(self.device, non_blocking=True)
                self.model.compute_logits(self.hidden[rows])
        elif isinstance(msg, CaptureGraphs):
            self._ensure_cache(msg.cache_shape, msg.num_layers)
            graphs = CudaGraphRunner(self.model, self.kv_caches, msg.max_batch, msg.max_model_len, msg.block_size,
                                     self.device)
            graphs.capture(capture_error_mode="thread_local", piecewise=msg.piecewise)
            self.graphs = graphs
        elif isinstance(msg, ComputeLogits):
            hidden = torch.empty(msg.rows_shape, dtype=self.dtype, device=self.device)
            dist.broadcast(hidden, src=0)
            self.model.compute_logits(hidden)
        elif isinstance(msg, CopyBlocks):
            copy_blocks(self.kv_caches, msg.src.to(self.device), msg.dst.to(self.device))
        elif isinstance(msg, FreeCache):
            self.graphs = None
            self.kv_caches = []
        elif isinstance(msg, Shutdown):
            if self.graphs is not None:   # before the communicators are destroyed (see destroy_tensor_parallel)
                self.graphs.release()
                self.graphs = None
            return False
        else:
            raise TypeError(f"tensor parallel worker: unknown message {type(msg).__name__}")
        return True

    @torch.inference_mode()
    def serve(self, conn: Connection) -> None:
        while self.handle(receive(conn)):
            pass


def _exit_when_orphaned(parent: int) -> None:
    """The driver died without telling us: leave instead of waiting in a collective forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(rank: int, spec: WorkerSpec, parent_pid: int, conn: Connection) -> None:
    """Entry point of a spawned worker process; `conn`: the read end of its control pipe."""
    logging.basicConfig(level=os.environ.get("KVFLEET_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.device_type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        # The GPU does this rank's math; CPU threads of its own would only spin against the driver's
        # host work on the same cores (vLLM's workers do the same).
        torch.set_num_threads(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    arm_hang_dump()
    model, device = build_shard(spec, rank)
    try:
        ShardWorker(model, device, spec.dtype).serve(conn)   # releases its graphs on Shutdown
    except BaseException:
        # Say why, then leave at once: leaving the group with collectives in flight can block, and the
        # driver (whose watchdog ends the engine when a worker exits) would wait for this one forever.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    destroy_tensor_parallel()
