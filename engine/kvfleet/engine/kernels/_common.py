"""Shared helpers for the Triton kernels: interpreter detection and input checks.

The kernels run compiled on CUDA and, for tests on machines without a GPU, under
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors. The interpreter
cannot multiply bfloat16 tiles with ``tl.dot`` (numpy has no bfloat16), so every
kernel that uses ``tl.dot`` takes an ``UPCAST`` flag that widens its operands to
float32 first when interpreting; compiled kernels keep the native dtype.
"""

from __future__ import annotations

import functools
import os
from typing import NoReturn

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_loop_bounds() -> None:
    """Let the interpreter use loaded scalars as ``range`` bounds with numpy >= 2.4.

    Triton 3.6's interpreter turns a tensor into a Python int with
    ``int(ndarray)``; a loaded scalar is a one-element 1-D array there, which
    numpy 2.4 no longer converts. Compiled kernels are unaffected.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_kvfleet_fixed", False):
        return

    def patched(tensor: type, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))  # type: ignore[attr-defined]

    patched._kvfleet_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if interpret_mode():
    _fix_interpreter_loop_bounds()


def triton_usable(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run for tensors on ``device``."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton ships with torch on Linux
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    return interpret_mode()


_INTERPRET = interpret_mode()  # fixed at import: Triton picks the interpreter when kernels are decorated


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact IEEE products (Triton defaults to tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(dtype: torch.dtype) -> bool:
    """Upcast tl.dot operands to float32 only in the interpreter, for bf16."""
    return _INTERPRET and dtype == torch.bfloat16


DEFAULT_SMS = 132   # an H100/H200; what the tiling heuristics assume off a GPU (the CPU tests)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device (cached: no device query per launch); ``DEFAULT_SMS`` elsewhere."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else DEFAULT_SMS


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fail(name: str, msg: str) -> NoReturn:
    """Raise ``ValueError`` naming the offending argument (callers test first, so the
    message is only formatted on failure: these wrappers run hundreds of times a step)."""
    raise ValueError(f"{name}: {msg}")


def int_from_env(name: str, default: int, lo: int, hi: int) -> int:
    """The integer environment knob `name` (`default` when unset or empty); ValueError naming it outside [lo, hi]."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        n = int(raw)
    except ValueError:
        fail(name, f"expected an integer in [{lo}, {hi}], got {raw!r}")
    if not (lo <= n <= hi):
        fail(name, f"expected an integer in [{lo}, {hi}], got {raw!r}")
    return n


def check(cond: bool, name: str, msg: str) -> None:
    """Raise ``ValueError`` naming the offending argument."""
    if not cond:
        fail(name, msg)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    last_contiguous: bool = True,
) -> None:
    """Validate a kernel argument's rank, dtype, device and innermost stride."""
    if not (isinstance(t, torch.Tensor)):
        fail(name, f"expected a tensor, got {type(t).__name__}")
    if ndim is not None:
        if not (t.dim() == ndim):
            fail(name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            fail(name, f"dtype {t.dtype} not in {allowed}")
    if device is not None:
        if not (t.device == device):
            fail(name, f"on {t.device}, expected {device}")
    if last_contiguous and t.numel() > 0:
        if not (t.stride(-1) == 1):
            fail(name, f"innermost stride must be 1, got {t.stride()}")


def check_paged_attention_args(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               query_start_loc: torch.Tensor) -> tuple[int, int, int, int, int]:
    """The checks every paged-attention wrapper makes; -> (block_size, Hkv, D, Hq, batch)."""
    check_tensor("q", q, ndim=3, dtype=SUPPORTED_DTYPES)
    check_tensor("out", out, ndim=3, dtype=q.dtype, device=q.device)
    if not (out.shape == q.shape):
        fail("out", f"shape {tuple(out.shape)} != q {tuple(q.shape)}")
    check_tensor("kv_cache", kv_cache, ndim=5, dtype=q.dtype, device=q.device)
    _, _, block_size, hkv, d = kv_cache.shape
    hq = q.shape[1]
    if not (q.shape[2] == d):
        fail("q", f"head_dim {q.shape[2]} != cache head_dim {d}")
    if not (hq % hkv == 0):
        fail("q", f"{hq} query heads not a multiple of {hkv} KV heads")
    check_tensor("block_tables", block_tables, ndim=2, dtype=torch.int32, device=q.device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtype=torch.int32, device=q.device)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtype=torch.int32, device=q.device)
    batch = seq_lens.shape[0]
    if not (query_start_loc.shape[0] == batch + 1):
        fail("query_start_loc", f"length must be B+1 = {batch + 1}")
    return block_size, hkv, d, hq, batch


def check_prefill_work(work: torch.Tensor, device: torch.device) -> int:
    """The checks on a prefill kernel's ``prefill_work`` list; -> its number of (sequence, query tile) pairs."""
    check_tensor("work", work, ndim=2, dtype=torch.int32, device=device)
    if not (work.shape[1] == 2):
        fail("work", f"expected [n, 2] (sequence, tile), got {tuple(work.shape)}")
    return int(work.shape[0])
