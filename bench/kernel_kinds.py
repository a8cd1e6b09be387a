"""Kernel time by kind from a torch.profiler run, for kvfleet's kernels and vLLM's alike.

Only device-side events are counted: a CPU op's own "self device time" is the time of the kernels it launched,
which are events of their own too (summing both counted every cuBLAS GEMM twice, once as `aten::mm`). On a
machine without a GPU (the dry runs), the aten ops' self CPU time stands in, so the same code runs there.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

# kinds in the order they are tried: the first pattern that matches a kernel's name (lower-cased) names its kind
KIND_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # before attention: vLLM's cache write is `reshape_and_cache_flash_kernel`
    ("rope + kv write", re.compile(r"rotary|rope|reshape_and_cache|cache_kernel")),
    ("attention", re.compile(r"prefill|decode_kernel|merge_kernel|shared_prefix|flash|fmha|attention|attn")),
    # after attention: FlashAttention-3's kernels are cutlass templates
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitkreduce|split_k_(reduce|sum)|scaled_mm|matmul"
                        r"|^aten::(mm|addmm|bmm|linear)$")),
    ("norm", re.compile(r"rms_?norm|layer_?norm|rsqrt")),
    ("activation", re.compile(r"silu|gelu|act_and_mul")),
    ("fp8 quant", re.compile(r"quant|e4m3")),
    ("sampling", re.compile(r"argmax|softmax|topk|top_k|sort|exponential|multinomial|token_bitmask|sampl")),
    ("copies", re.compile(r"memcpy|memset|copy|gather|index|fill")),
)
OTHER = "other"
KINDS = tuple(k for k, _ in KIND_PATTERNS) + (OTHER,)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, pattern in KIND_PATTERNS:
        if pattern.search(low):
            return kind
    return OTHER


@dataclass(frozen=True)
class KernelTotal:
    name: str
    calls: int
    ms: float
    kind: str
    median_us: float = 0.0   # one call's time: a kernel launched in steps of two sorts (decode-only and mixed)
    p90_us: float = 0.0      # shows it here, where the total alone cannot


def _counted_us(e: Any, on_device: bool) -> float:
    """An event's (or average's) own time in us where it counts (device kernels on a GPU, aten ops on a CPU), else 0:
    a CPU op's self device time is its kernels' time, which are events of their own."""
    from torch.autograd import DeviceType

    if on_device:
        return 0.0 if e.device_type == DeviceType.CPU else float(e.self_device_time_total)
    return float(e.self_cpu_time_total) if e.key.startswith("aten::") else 0.0


def per_call_us(events: Iterable[Any], on_device: bool) -> dict[str, list[float]]:
    """Each counted kernel's (or aten op's) calls, in us."""
    calls: dict[str, list[float]] = defaultdict(list)
    for e in events:
        us = _counted_us(e, on_device)
        if us > 0:
            calls[e.key].append(us)
    return calls


def kernel_totals(prof: Any, on_device: bool) -> list[KernelTotal]:
    """Each kernel's (on a GPU) or aten op's (on a CPU) total time in the profile, longest first, with the median
    and 90th percentile of its calls."""
    calls = per_call_us(prof.events(), on_device)
    rows = []
    for e in prof.key_averages():
        us = _counted_us(e, on_device)
        if us > 0:
            each = sorted(calls.get(e.key, []))
            median, p90 = (statistics.median(each), each[math.ceil(0.9 * len(each)) - 1]) if each else (0.0, 0.0)
            rows.append(KernelTotal(e.key, int(e.count), us / 1e3, kernel_kind(e.key), median, p90))
    return sorted(rows, key=lambda r: -r.ms)


def ms_by_kind(totals: list[KernelTotal]) -> dict[str, float]:
    out = dict.fromkeys(KINDS, 0.0)
    for t in totals:
        out[t.kind] += t.ms
    return out


def kind_rows(ours: dict[str, float], theirs: dict[str, float]) -> list[dict[str, Any]]:
    """One row per kind (and the total): both engines' ms, the difference, and ours over theirs."""
    rows = []
    for kind in (*KINDS, "total"):
        a = sum(ours.values()) if kind == "total" else ours.get(kind, 0.0)
        b = sum(theirs.values()) if kind == "total" else theirs.get(kind, 0.0)
        if a == 0.0 and b == 0.0:
            continue
        rows.append({"kind": kind, "ours_ms": a, "theirs_ms": b, "diff_ms": a - b,
                     "ratio": a / b if b > 0 else None})
    return rows
