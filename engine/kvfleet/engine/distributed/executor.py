"""The driver side of tensor parallelism: rank 0 in the engine process, workers in spawned processes.

`start_tensor_parallel(...)` spawns ranks 1..N-1, joins the group as rank 0 and loads rank 0's
shards; the returned `TensorParallelExecutor` is the model runner's executor
(`kvfleet.engine.model_executor.ModelExecutor`): it mirrors every call to the workers (a message
through each worker's pipe, then the step's tensors over the group) before running it on its own
shard. A step's forward tells the workers which rows' logits follow, so they compute theirs with
the step and `compute_logits` sends nothing. On CUDA every rank captures the same decode graphs
(`capture_graphs`); a replay is one "replay" message plus the packed inputs. A worker that dies
makes a watchdog log the rank and exit code and end the process (`on_worker_death`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Optional

import torch
import torch.distributed as dist

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.cuda_graphs import CudaGraphRunner, tp_graph_mode
from kvfleet.engine.distributed.control import (
    CaptureGraphs,
    ComputeLogits,
    ControlSender,
    CopyBlocks,
    FreeCache,
    Message,
    Shutdown,
    StepHeader,
)
from kvfleet.engine.distributed.parallel_state import arm_hang_dump, destroy_tensor_parallel, local_kv_heads
from kvfleet.engine.distributed.worker import WorkerSpec, build_shard, pack_step, worker_main
from kvfleet.engine.kv_cache import block_pairs, copy_blocks
from kvfleet.engine.models.base import CausalLM

logger = logging.getLogger(__name__)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die(message: str) -> None:
    logger.critical(message)
    print(f"kvfleet: {message}", flush=True, file=sys.stderr)
    os._exit(70)


class TensorParallelExecutor:
    """Rank 0's shard plus the messages that keep the workers in step (a `ModelExecutor`)."""

    def __init__(self, model: CausalLM, procs: Sequence[BaseProcess], num_kv_heads: int, device: torch.device,
                 on_worker_death: Callable[[str], None] = _die, control: ControlSender | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = model.config.dtype
        self.num_kv_heads = num_kv_heads
        self.graphs: Optional[CudaGraphRunner] = None
        self.replays = 0   # decode steps replayed from the graphs (on every rank)
        self.control = control or ControlSender([])
        self._logits_announced = False   # the workers computed the logits of the last step's logit_rows
        self.procs = procs
        self._closed = threading.Event()
        self._on_death = on_worker_death
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # --- the executor interface ---------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, logit_rows: Sequence[int] = (), *,
                eager: bool = False) -> torch.Tensor:
        graphs = self.graphs
        if graphs is not None and not eager and graphs.can_run(input_ids.shape[0], attn_metadata):
            self._send_step(True, input_ids, positions, kv_caches, attn_metadata, logit_rows)
            self.replays += 1
            return graphs.run(input_ids, positions, kv_caches, attn_metadata)
        self._send_step(False, input_ids, positions, kv_caches, attn_metadata, logit_rows)
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._logits_announced:   # the workers did theirs after the step
            self._logits_announced = False
            return self.model.compute_logits(hidden)
        self._send(ComputeLogits(tuple(hidden.shape)))
        rows = hidden.to(self.dtype).contiguous()
        dist.broadcast(rows, src=0)
        return self.model.compute_logits(rows)

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        """The copies in this rank's cache and, mirrored, in the workers' caches."""
        if not pairs:
            return
        src, dst = block_pairs(pairs, torch.device("cpu"))
        self._send(CopyBlocks(src, dst))
        copy_blocks(kv_caches, src.to(self.device), dst.to(self.device))

    def capture_graphs(self, kv_caches: list[torch.Tensor], max_batch: int, max_model_len: int,
                       block_size: int, mixed_max_tokens: int = 0) -> None:
        """Decode CUDA graphs on every rank: each captures the same batch sizes in the same order over
        its own shard and KV cache, so the all-reduces inside the graphs pair up at replay (or, with
        KVFLEET_TP_CUDA_GRAPHS=piecewise, the eager all-reduces between the graphs' parts). Steps with
        prefill stay eager under tensor parallelism (`mixed_max_tokens` is not used)."""
        mode = tp_graph_mode()
        if mode == "eager":
            logger.info("tensor parallel: decode steps run eager (KVFLEET_TP_CUDA_GRAPHS=0)")
            return
        piecewise = mode == "piecewise"
        self._send(CaptureGraphs(tuple(kv_caches[0].shape), len(kv_caches), max_batch, max_model_len, block_size,
                                 piecewise))
        graphs = CudaGraphRunner(self.model, kv_caches, max_batch, max_model_len, block_size, self.device)
        graphs.capture(capture_error_mode="thread_local", piecewise=piecewise)  # NCCL's threads keep running
        self.graphs = graphs

    def free_cache(self) -> None:
        self._send(FreeCache())

    def _send(self, msg: Message) -> None:
        self._check_workers()
        self.control.send(msg)

    def _send_step(self, replay: bool, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], md: AttentionMetadata, logit_rows: Sequence[int]) -> None:
        """Tell the workers to run this step (eager, or `replay` of a captured graph)."""
        header = StepHeader(
            num_tokens=int(input_ids.shape[0]), num_seqs=len(md.seq_lens_cpu),
            table_width=int(md.block_tables.shape[1]), max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            query_start_loc_cpu=list(md.query_start_loc_cpu), seq_lens_cpu=list(md.seq_lens_cpu),
            cache_shape=tuple(kv_caches[0].shape), num_layers=len(kv_caches),
            logit_rows=tuple(int(r) for r in logit_rows), replay=replay,
        )
        self._send(header)  # host data only: no wait for the device
        self._logits_announced = bool(header.logit_rows)
        dist.broadcast(pack_step(input_ids, positions, md), src=0)

    # --- life cycle ---------------------------------------------------------------
    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                raise RuntimeError(f"tensor parallel worker rank {rank} died (exit code {proc.exitcode})")

    def _watch(self) -> None:
        while not self._closed.wait(0.5):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.exitcode is not None and not self._closed.is_set():
                    self._closed.set()
                    self._on_death(f"tensor parallel worker rank {rank} died (exit code {proc.exitcode}); "
                                   "the engine cannot continue")
                    return

    def shutdown(self, timeout_s: float = 30.0) -> None:
        # CUDA graphs go first: NCCL's destroy waits for every live graph that captured its communicator
        # (the workers release theirs on Shutdown)
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self._closed.is_set():
            alive = [p for p in self.procs if p.exitcode is None]
        else:
            self._closed.set()
            alive = list(self.procs)
            try:
                self.control.send(Shutdown())
            except Exception as exc:  # a dead peer: nothing left to tell
                logger.warning("tensor parallel shutdown broadcast failed: %s", exc)
        # leave the group before waiting: the workers leave it too on their way out (NCCL pairs them)
        destroy_tensor_parallel()
        self.control.close()
        for proc in alive:
            proc.join(timeout_s)
            if proc.exitcode is None:
                logger.warning("tensor parallel worker %s did not exit; killing it", proc.name)
                proc.kill()
                proc.join(5)


def _watch_startup(procs: Sequence[BaseProcess], started: threading.Event, on_death: Callable[[str], None]) -> None:
    """A worker that fails while loading would leave rank 0 waiting in the rendezvous: report it instead."""
    while not started.wait(0.5):
        for rank, proc in enumerate(procs, start=1):
            if proc.exitcode is not None:
                on_death(f"tensor parallel worker rank {rank} exited (code {proc.exitcode}) while loading the model")
                return


def start_tensor_parallel(
    model: str,
    tp_size: int,
    device_type: str,
    dtype: torch.dtype,
    *,
    max_model_len: int | None = None,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    timeout_s: float = 300.0,
    on_worker_death: Callable[[str], None] = _die,
) -> TensorParallelExecutor:
    """Spawn ranks 1..tp_size-1, become rank 0, load every rank's shards; -> rank 0's executor."""
    if tp_size < 2:
        raise ValueError(f"tensor_parallel_size: {tp_size} needs no workers (use the plain model)")
    if device_type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} > {torch.cuda.device_count()} visible GPUs")
    spec = WorkerSpec(model=str(model), max_model_len=max_model_len, dtype=dtype, load_format=load_format,
                      seed=seed, device_type=device_type, tp_size=tp_size,
                      init_method=f"tcp://127.0.0.1:{free_loopback_port()}", timeout_s=timeout_s,
                      quantization=quantization)
    arm_hang_dump()
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, tp_size)]   # (worker's read end, driver's write end)
    procs = [ctx.Process(target=worker_main, args=(rank, spec, os.getpid(), pipes[rank - 1][0]), daemon=True,
                         name=f"kvfleet-tp{rank}") for rank in range(1, tp_size)]
    for proc in procs:
        proc.start()
    for reader, _ in pipes:
        reader.close()   # the worker holds it now; the driver's copy would keep the pipe open past a worker's death
    started = threading.Event()
    threading.Thread(target=_watch_startup, args=(procs, started, on_worker_death), daemon=True).start()
    try:
        shard, device = build_shard(spec, 0)  # blocks until every rank has joined the group
    except BaseException:
        for proc in procs:
            proc.kill()
        for _, writer in pipes:
            writer.close()
        destroy_tensor_parallel()
        raise
    finally:
        started.set()
    heads = local_kv_heads(shard.config.num_kv_heads, tp_size)
    logger.info("tensor parallel %d: %d KV heads per rank", tp_size, heads)
    return TensorParallelExecutor(shard, procs, heads, device, on_worker_death,
                                  ControlSender([writer for _, writer in pipes]))
