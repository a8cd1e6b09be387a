"""Which GEMM multiplies a bf16/fp16 linear layer (models/linear.py): cuBLAS (``F.linear``) or, for a step of a few
rows, our Triton kernel (``kernels/small_m_gemm.py``), which reads the weights once in one launch where cuBLAS's
GEMV adds a split-K reduction launch.

``KVFLEET_SMALL_M_GEMM_MAX`` (read once per process): N in 1..16, the Triton kernel for a product of 1..N rows of
bf16/fp16 on CUDA with a contiguous weight; 0, always ``F.linear``. The default, 1, is where the H200 sweep
(``bench/gpu_small_m_gemm_sweep.py``, issue 16 lease 12) has it beat cuBLAS on every Llama-3.1-8B shape (1.03-1.11x;
at 2 rows and above they are level or cuBLAS wins): a batch-1 step's linears 3.88 ms instead of 4.21, and
``kvfleet serve``'s TPOT p50 at 0.5 req/s 4.47 ms instead of 4.70. CUDA graphs capture decode at fixed batch sizes,
so each captured size keeps one path. FP8 layers (models/fp8.py) have their own kernel and setting.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F

from kvfleet.engine.kernels.small_m_gemm import MAX_M, small_m_gemm

SMALL_M_GEMM_MAX_ENV = "KVFLEET_SMALL_M_GEMM_MAX"
TRITON_DTYPES = (torch.bfloat16, torch.float16)

LinearPath = Literal["triton", "torch"]


@dataclasses.dataclass(frozen=True)
class SmallMGemmSettings:
    """``max_m``: the most rows the Triton kernel takes (0: never)."""

    max_m: int = 1


def parse_small_m_gemm_settings(env: Mapping[str, str]) -> SmallMGemmSettings:
    """The settings from environment variables (a ValueError names the variable)."""
    raw = env.get(SMALL_M_GEMM_MAX_ENV, "").strip()
    try:
        max_m = int(raw) if raw else SmallMGemmSettings.max_m
    except ValueError:
        max_m = -1
    if not 0 <= max_m <= MAX_M:
        raise ValueError(f"{SMALL_M_GEMM_MAX_ENV}: expected an integer in [0, {MAX_M}] (0: always F.linear), "
                         f"got {raw!r}")
    return SmallMGemmSettings(max_m=max_m)


@functools.cache
def small_m_gemm_settings() -> SmallMGemmSettings:
    """The process's settings, read from the environment once."""
    return parse_small_m_gemm_settings(os.environ)


def linear_path(rows: int, dtype: torch.dtype, weight_dtype: torch.dtype, device_type: str,
                weight_contiguous: bool, max_m: int) -> LinearPath:
    """Which GEMM runs ``rows`` rows of ``dtype`` against a weight: the Triton kernel only where it applies (CUDA,
    bf16/fp16 on both sides, a contiguous weight) and the rows are within ``max_m``."""
    if (1 <= rows <= max_m and device_type == "cuda" and dtype in TRITON_DTYPES and weight_dtype == dtype
            and weight_contiguous):
        return "triton"
    return "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           settings: SmallMGemmSettings | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the Triton kernel where ``linear_path`` says so (``x [..., K]``)."""
    max_m = (settings or small_m_gemm_settings()).max_m
    if max_m == 0:   # off: no further checks on the hot path
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if linear_path(rows, x.dtype, weight.dtype, x.device.type, weight.is_contiguous(), max_m) == "torch":
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    y = small_m_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])
