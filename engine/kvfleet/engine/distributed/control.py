"""The driver's control messages to its tensor-parallel workers, and their channel: one pipe per worker.

A message is one of the records below (small, host-only, picklable; plain frozen dataclasses:
slots would make the step header's pickling slower). It is pickled once and
written to every worker's pipe; the driver never waits for a reply. This replaced broadcasting
each message over a gloo group (two gloo collectives per message, a size and a payload, with the
worker's receive on the critical path of every step). A worker whose driver is gone reads
end-of-file and leaves.

Messages: `StepHeader` (a forward, eager or a captured graph's replay; its tensors follow packed
over the tensor group: worker.pack_step), `ComputeLogits`, `CopyBlocks`, `CaptureGraphs`,
`FreeCache`, `Shutdown`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Union

import torch


@dataclass(frozen=True)
class StepHeader:
    """Host-side shape of one forward; the tensors travel packed (see worker.pack_step)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    cache_shape: tuple[int, ...]
    num_layers: int
    logit_rows: tuple[int, ...] = ()   # rows whose logits the driver computes after this forward
    replay: bool = False               # replay the captured decode graph of this batch instead of eager

    @property
    def packed_len(self) -> int:
        return 3 * self.num_tokens + 2 * self.num_seqs + 1 + self.num_seqs * self.table_width


@dataclass(frozen=True)
class ComputeLogits:
    """The driver computes logits of hidden rows it did not announce with the step: they follow,
    broadcast over the group, in the model dtype."""

    rows_shape: tuple[int, ...]


@dataclass(frozen=True)
class CopyBlocks:
    """Copy-on-write: block dst[i] of every layer becomes a copy of block src[i]."""

    src: torch.Tensor   # long, on the host
    dst: torch.Tensor


@dataclass(frozen=True)
class CaptureGraphs:
    """Capture decode CUDA graphs over a cache of this shape, as the driver does (same sizes, same order)."""

    cache_shape: tuple[int, ...]
    num_layers: int
    max_batch: int
    max_model_len: int
    block_size: int
    piecewise: bool


@dataclass(frozen=True)
class FreeCache:
    """The driver dropped its KV cache (after profiling): drop yours and the graphs over it."""


@dataclass(frozen=True)
class Shutdown:
    """Release the graphs, leave the group, exit."""


Message = Union[StepHeader, ComputeLogits, CopyBlocks, CaptureGraphs, FreeCache, Shutdown]


class WorkerGone(RuntimeError):
    """A worker's end of the pipe is closed: it died."""


class ControlSender:
    """The driver's ends (one writable connection per worker, rank order)."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns

    def send(self, msg: Message) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise WorkerGone(f"tensor parallel worker rank {rank} is gone ({exc})") from None

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def receive(conn: Connection) -> Message:
    """The next message for this worker; `Shutdown()` when the driver's end is closed."""
    try:
        msg = pickle.loads(conn.recv_bytes())
    except (EOFError, ConnectionResetError, OSError):
        return Shutdown()
    if not isinstance(msg, (StepHeader, ComputeLogits, CopyBlocks, CaptureGraphs, FreeCache, Shutdown)):
        raise TypeError(f"tensor parallel worker: unknown message {type(msg).__name__}")
    return msg
