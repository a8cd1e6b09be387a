"""All-reduce straight through NCCL's C API (ctypes), on the caller's CUDA stream.

A raw `ncclAllReduce` is one C call on the current stream: no side stream and its events, no work
object, no flight-recorder entry, so a captured graph holds the collective alone and an eager call
costs ~15 us of host time against ~24 us through torch.distributed (two H200s; vLLM's pynccl follows
the same idea). Measured end to end it lost, though (bench/NOTES.md, tensor parallelism): decode steps
~3 % shorter, prefill steps ~25 % longer, Llama-3.1-8B chat-mix 6-10 % fewer tokens/s than through
torch.distributed. So it is opt-in (KVFLEET_TP_ALLREDUCE=nccl). It uses the
libnccl that PyTorch ships (`nvidia/nccl/lib/libnccl.so.2`), or KVFLEET_NCCL_LIBRARY.

The communicator's unique id travels over the existing gloo control group; every rank of the group
must create its `NcclCommunicator` at the same point (NCCL's init is a rendezvous).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from typing import Any

import torch

from kvfleet.engine.env_settings import EnvSettingError

logger = logging.getLogger(__name__)

NCCL_UNIQUE_ID_BYTES = 128  # nccl.h: typedef struct { char internal[128]; } ncclUniqueId;
NCCL_SUM = 0
# nccl.h ncclDataType_t
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclError(RuntimeError):
    pass


def library_candidates() -> list[str]:
    """Where libnccl may be: the environment's choice, PyTorch's wheel dependency, the loader's path."""
    found = []
    if os.environ.get("KVFLEET_NCCL_LIBRARY"):
        found.append(os.environ["KVFLEET_NCCL_LIBRARY"])
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*")))
    found.append("libnccl.so.2")
    return found


class NcclLibrary:
    """The few NCCL entry points we call, with their C signatures."""

    def __init__(self, path: str | None = None) -> None:
        errors = []
        for candidate in [path] if path else library_candidates():
            try:
                self.lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as exc:
                errors.append(f"{candidate}: {exc}")
        else:
            raise NcclError("NCCL library not found (set KVFLEET_NCCL_LIBRARY): " + "; ".join(errors))
        lib = self.lib
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.restype = ctypes.c_int
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.restype = ctypes.c_int
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.restype = ctypes.c_int
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId, ctypes.c_int]
        lib.ncclAllReduce.restype = ctypes.c_int
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommDestroy.restype = ctypes.c_int
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise NcclError(f"{what} failed: {self.lib.ncclGetErrorString(result).decode()} (ncclResult {result})")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        major, rest = divmod(v.value, 10000)   # NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH
        return f"{major}.{rest // 100}.{rest % 100}"

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))


class NcclCommunicator:
    """One NCCL communicator over this process's CUDA device; `all_reduce` sums in place on the
    current stream (capturable in a CUDA graph)."""

    def __init__(self, lib: NcclLibrary, unique_id: bytes, rank: int, world_size: int,
                 device: torch.device) -> None:
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id: {NCCL_UNIQUE_ID_BYTES} bytes expected, got {len(unique_id)}")
        self.lib, self.rank, self.world_size, self.device = lib, rank, world_size, device
        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            lib.check(lib.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank), "ncclCommInitRank")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device or not x.is_contiguous():
            raise ValueError(f"all_reduce: a contiguous tensor on {self.device} expected, got {x.device}")
        dtype = NCCL_DTYPES.get(x.dtype)
        if dtype is None:
            raise ValueError(f"all_reduce: dtype {x.dtype} has no NCCL type")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.lib.check(self.lib.lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()),
                                                  x.numel(), dtype, NCCL_SUM, self.comm, ctypes.c_void_p(stream)),
                       "ncclAllReduce")
        return x

    def close(self) -> None:
        if self.comm:
            self.lib.check(self.lib.lib.ncclCommDestroy(self.comm), "ncclCommDestroy")
            self.comm = ctypes.c_void_p()


def use_direct_nccl() -> bool:
    """Tensor-parallel all-reduces on GPUs go through torch.distributed (KVFLEET_TP_ALLREDUCE=torch, the
    default: the faster of the two end to end on two H200s, its eager prefill all-reduces especially) or
    through `NcclCommunicator` (=nccl: ~3 % shorter decode steps, but prefill steps ~25 % longer)."""
    choice = os.environ.get("KVFLEET_TP_ALLREDUCE", "torch")
    if choice not in ("torch", "nccl"):
        raise EnvSettingError(f"KVFLEET_TP_ALLREDUCE: 'torch' or 'nccl', got {choice!r}")
    return choice == "nccl"


def make_communicator(rank: int, world_size: int, device: torch.device, share: Any) -> NcclCommunicator:
    """Rank 0 draws the unique id, `share(obj)` (the control group's broadcast) gives it to every rank."""
    lib = NcclLibrary()
    uid = share(lib.unique_id() if rank == 0 else None)
    comm = NcclCommunicator(lib, uid, rank, world_size, device)
    logger.info("direct NCCL %s communicator, rank %d/%d on %s (%s)", lib.version(), rank, world_size, device,
                lib.path)
    return comm
