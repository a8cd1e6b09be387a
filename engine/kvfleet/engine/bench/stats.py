"""Small pure helpers for benchmark statistics."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentiles(values: Sequence[float | None], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float] | None:
    """``{"mean", "p50", ...}`` in the values' unit, or None when there are none."""
    vals = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if vals.size == 0:
        return None
    out = {"mean": float(vals.mean())}
    out.update({f"p{int(q)}": float(np.percentile(vals, q)) for q in qs})
    return out


def request_latencies(arrival: float, first_token: float | None, finished: float | None,
                      num_output: int) -> tuple[float | None, float | None]:
    """(TTFT, time per output token after the first) of one request from engine timestamps."""
    if first_token is None:
        return None, None
    ttft = first_token - arrival
    if finished is None or num_output < 2:
        return ttft, None
    return ttft, (finished - first_token) / (num_output - 1)


def kv_fragmentation(blocks_used: int, block_size: int, tokens_in_kv: int, num_seqs: int) -> dict[str, float]:
    """Slots allocated but holding no token, overall and per sequence (in blocks)."""
    slots = blocks_used * block_size
    waste = max(0, slots - tokens_in_kv)
    return {"wasted_slots": waste, "wasted_fraction": waste / slots if slots else 0.0,
            "wasted_blocks_per_seq": (waste / block_size / num_seqs) if num_seqs else 0.0}
