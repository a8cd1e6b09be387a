"""The tensor-parallel group of this process (one per process; size 1 when not distributed).

Layers read rank/size from here at construction and call tp_all_reduce /
tp_all_gather in forward; both are no-ops at size 1, so single-process code never
touches torch.distributed. A second, gloo group carries small host objects at setup (the
direct NCCL communicator's unique id) even when the tensors go over NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from kvfleet.engine.env_settings import EnvSettingError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _TPState:
    rank: int = 0
    size: int = 1
    owns_process_group: bool = False
    control_group: Any = None
    nccl: Any = None   # a direct NcclCommunicator (KVFLEET_TP_ALLREDUCE=nccl, opt-in), else torch.distributed


_STATE = _TPState()


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
) -> None:
    """Join the group (gloo on CPU, nccl on CUDA). init_method e.g. tcp://127.0.0.1:29555."""
    global _STATE
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"tensor_parallel_size: rank {rank} is outside a group of {world_size}")
    if world_size == 1:
        _STATE = _TPState()
        return
    # Keep all traffic on loopback: gloo would otherwise pick the interface of the host name.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    backend = backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")
    if backend == "nccl":
        # NCCL >= 2.19 allocates through cuMem by default, which costs GPU memory for every CUDA graph
        # that captures an all-reduce (NVIDIA/nccl#1234); vLLM turns it off the same way. A value the
        # user set wins.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    timeout = datetime.timedelta(seconds=timeout_s)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        owns = True
    elif dist.get_world_size() != world_size:
        raise ValueError(f"tensor_parallel_size: {world_size} != torch.distributed world size {dist.get_world_size()}")
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    nccl = None
    if backend == "nccl":
        from kvfleet.engine.distributed.nccl import make_communicator, use_direct_nccl

        if use_direct_nccl():
            def share(obj: Any) -> Any:
                box = [obj]
                dist.broadcast_object_list(box, src=0, group=control)
                return box[0]

            nccl = make_communicator(rank, world_size, torch.device(device), share)
    _STATE = _TPState(rank=rank, size=world_size, owns_process_group=owns, control_group=control, nccl=nccl)
    logger.info("tensor parallel rank %d/%d (%s)", rank, world_size, backend)


def arm_hang_dump() -> None:
    """With KVFLEET_HANG_DUMP_S=N, print every thread's Python stack to stderr every N seconds (this
    process): a debugging aid for runs where one rank waits in a collective for a peer that never comes."""
    raw = os.environ.get("KVFLEET_HANG_DUMP_S", "0") or "0"
    try:
        seconds = float(raw)
    except ValueError:
        raise EnvSettingError(f"KVFLEET_HANG_DUMP_S: seconds between stack dumps, got {raw!r}") from None
    if seconds > 0:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)


def _bounded(fn: Callable[[], Any], seconds: float, what: str) -> None:
    """Run a teardown call that may block (NCCL waits for what still uses the communicator) for at most
    `seconds`: the process is leaving, so a stuck teardown is reported and left behind, never waited on."""
    import threading

    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # leaving anyway
            errors.append(exc)

    t = threading.Thread(target=call, name=f"teardown-{what}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        logger.warning("%s did not finish in %g s; leaving it behind", what, seconds)
    elif errors:
        logger.warning("%s failed: %s", what, errors[0])


def destroy_tensor_parallel(timeout_s: float = 20.0) -> None:
    """Leave the group. CUDA graphs that captured its collectives must be gone first (NCCL's destroy
    waits for every graph still holding the communicator: that was the "hang" of the first 2-GPU runs);
    the teardown is bounded anyway, so a peer that vanished cannot keep this process from exiting."""
    global _STATE
    import gc

    gc.collect()   # graphs in reference cycles
    if _STATE.nccl is not None:
        _bounded(_STATE.nccl.close, timeout_s, "closing the NCCL communicator")
    if _STATE.owns_process_group and dist.is_initialized():
        _bounded(dist.destroy_process_group, timeout_s, "destroying the process group")
    _STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


_CUT: Callable[[torch.Tensor], torch.Tensor] | None = None


@contextlib.contextmanager
def all_reduce_cut(fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While piecewise CUDA graphs are captured, every tensor-parallel all-reduce calls `fn(x)`
    instead (it ends one graph at that point and starts the next; see cuda_graphs.PiecewiseGraph)."""
    global _CUT
    prev, _CUT = _CUT, fn
    try:
        yield
    finally:
        _CUT = prev


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place when distributed)."""
    if _STATE.size == 1:
        return x
    if _CUT is not None:
        return _CUT(x)
    return tp_all_reduce_now(x)


def tp_all_reduce_now(x: torch.Tensor) -> torch.Tensor:
    """The all-reduce itself (what a piecewise graph's replay runs between its parts)."""
    if _STATE.nccl is not None:
        return _STATE.nccl.all_reduce(x)
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' shards along `dim`, in rank order."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (split evenly, or one replicated head when fewer heads than ranks)."""
    return max(1, num_kv_heads // tp_size)
