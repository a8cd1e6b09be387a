"""The driver side of tensor parallelism: rank 0 in the engine process, workers in spawned processes.

`start_tensor_parallel(...)` spawns ranks 1..N-1, joins the group as rank 0 and loads
rank 0's shards; the returned `TensorParallelModel` has the model interface
(`model(ids, positions, kv_caches, md)`, `compute_logits(rows)`), and mirrors every
call to the workers (a message through each worker's pipe, then the step's tensors over the
group) before running it locally; `expect_logits(rows)` before a step lets the workers compute
their logits without a second message. The engine additionally calls
`copy_blocks(pairs)` after its own copy-on-write copies and `shutdown()` at the end,
sizes its KV cache with `num_kv_heads` (this rank's heads), and on CUDA captures decode
graphs on every rank with `capture_graphs(...)`. A worker that dies
makes a watchdog log the rank and exit code and end the process (`on_worker_death`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.distributed.control import ControlSender
from kvfleet.engine.distributed.parallel_state import arm_hang_dump, destroy_tensor_parallel, local_kv_heads
from kvfleet.engine.distributed.worker import StepHeader, WorkerSpec, build_shard, pack_step, worker_main

logger = logging.getLogger(__name__)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die(message: str) -> None:
    logger.critical(message)
    print(f"kvfleet: {message}", flush=True, file=__import__("sys").stderr)
    os._exit(70)


class TensorParallelModel:
    """Rank 0's shard plus the broadcast that keeps the workers in step."""

    def __init__(self, model: torch.nn.Module, procs: list[Any], num_kv_heads: int, dtype: torch.dtype,
                 on_worker_death: Callable[[str], None] = _die, control: ControlSender | None = None) -> None:
        self.model = model
        self.control = control or ControlSender([])
        self._logit_rows: tuple[int, ...] = ()   # announced for the next step (expect_logits)
        self._logits_announced = False
        self.config = getattr(model, "config", None)
        self.procs = procs
        self.num_kv_heads = num_kv_heads
        self.dtype = dtype
        self._closed = threading.Event()
        self._on_death = on_worker_death
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # --- the model interface ------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.forward(input_ids, positions, kv_caches, attn_metadata)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        self._send_step("forward", input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def expect_logits(self, rows: list[int]) -> None:
        """The next step's caller will compute the logits of these rows of its hidden states: the workers
        are told with the step and compute theirs right after it, so `compute_logits` then sends nothing
        (no second message and no broadcast of the rows)."""
        self._logit_rows = tuple(int(r) for r in rows)

    def _send(self, msg: tuple[Any, ...]) -> None:
        self._check_workers()
        self.control.send(msg)

    def _send_step(self, cmd: str, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], md: AttentionMetadata) -> None:
        """Tell the workers to run `cmd` ("forward" eager, "replay" a captured graph) on this step."""
        rows, self._logit_rows = self._logit_rows, ()
        header = StepHeader(
            num_tokens=int(input_ids.shape[0]), num_seqs=len(md.seq_lens_cpu),
            table_width=int(md.block_tables.shape[1]), max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            query_start_loc_cpu=list(md.query_start_loc_cpu),
            seq_lens_cpu=list(md.seq_lens_cpu), cache_shape=tuple(kv_caches[0].shape), num_layers=len(kv_caches),
            logit_rows=rows,
        )
        self._send((cmd, header))  # host data only: no wait for the device
        self._logits_announced = bool(rows)
        dist.broadcast(pack_step(input_ids, positions, md), src=0)

    def capture_graphs(self, kv_caches: list[torch.Tensor], max_batch: int, max_model_len: int, block_size: int,
                       device: torch.device, piecewise: bool = False) -> "TensorParallelGraphRunner":
        """Decode CUDA graphs on every rank: each captures the same batch sizes in the same order over
        its own shard and KV cache, so the all-reduces inside the graphs pair up at replay (or, with
        `piecewise`, the eager all-reduces between the graphs' parts)."""
        from kvfleet.engine.cuda_graphs import CudaGraphRunner

        self._send(("capture", tuple(kv_caches[0].shape), len(kv_caches), max_batch, max_model_len, block_size,
                    piecewise))
        local = CudaGraphRunner(self.model, kv_caches, max_batch, max_model_len, block_size, device)
        local.capture(capture_error_mode="thread_local", piecewise=piecewise)  # NCCL's threads keep running
        return TensorParallelGraphRunner(self, local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._logits_announced:   # the workers did theirs after the step (expect_logits)
            self._logits_announced = False
            return self.model.compute_logits(hidden)
        self._send(("logits", tuple(hidden.shape)))
        rows = hidden.to(self.dtype).contiguous()
        dist.broadcast(rows, src=0)
        return self.model.compute_logits(rows)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mirror the engine's copy-on-write block copies in the workers' caches."""
        if pairs:
            self._send(("copy_blocks", torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])))

    def free_cache(self) -> None:
        self._send(("free_cache",))

    def parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.parameters(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.named_parameters(*args, **kwargs)

    @property
    def lm_head(self) -> Any:
        return getattr(self.model, "lm_head", None)

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
        if self._closed.is_set():
            alive = [p for p in self.procs if p.exitcode is None]
        else:
            self._closed.set()
            alive = list(self.procs)
            try:
                self.control.send(("shutdown",))
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


class TensorParallelGraphRunner:
    """The model runner's `graph_runner` under tensor parallelism: the step's inputs go to the
    workers, then every rank replays its own graph of the same batch size."""

    def __init__(self, tp: TensorParallelModel, local: Any) -> None:
        self.tp, self.local = tp, local
        self.sizes = local.sizes
        self.replays = 0

    def can_run(self, num_tokens: int, attn_metadata: AttentionMetadata) -> bool:
        return bool(self.local.can_run(num_tokens, attn_metadata))

    def release(self) -> None:
        self.local.release()   # the workers release theirs on "shutdown"

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            attn_metadata: AttentionMetadata) -> torch.Tensor:
        self.tp._send_step("replay", input_ids, positions, kv_caches, attn_metadata)
        self.replays += 1
        return self.local.run(input_ids, positions, kv_caches, attn_metadata)


def _watch_startup(procs: list[Any], started: threading.Event, on_death: Callable[[str], None]) -> None:
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
    timeout_s: float = 300.0,
    on_worker_death: Callable[[str], None] = _die,
) -> TensorParallelModel:
    """Spawn ranks 1..tp_size-1, become rank 0, load every rank's shards; -> the driver model."""
    if tp_size < 2:
        raise ValueError(f"tensor_parallel_size: {tp_size} needs no workers (use the plain model)")
    if device_type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tensor_parallel_size: {tp_size} > {torch.cuda.device_count()} visible GPUs")
    spec = WorkerSpec(model=str(model), max_model_len=max_model_len, dtype=dtype, load_format=load_format,
                      seed=seed, device_type=device_type, tp_size=tp_size,
                      init_method=f"tcp://127.0.0.1:{free_loopback_port()}", timeout_s=timeout_s)
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
        shard, _ = build_shard(spec, 0)  # blocks until every rank has joined the group
    except BaseException:
        for proc in procs:
            proc.kill()
        for _, writer in pipes:
            writer.close()
        destroy_tensor_parallel()
        raise
    finally:
        started.set()
    cfg = shard.config  # type: ignore[attr-defined]
    logger.info("tensor parallel %d: %d KV heads per rank", tp_size, local_kv_heads(cfg.num_kv_heads, tp_size))
    return TensorParallelModel(shard, procs, local_kv_heads(cfg.num_kv_heads, tp_size), dtype, on_worker_death,
                               ControlSender([writer for _, writer in pipes]))
