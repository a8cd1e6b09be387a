"""Which allocator calls make the host wait for work already queued on the GPU (H200, issue 16).

Each probe queues ~200 ms of GPU work (`torch.cuda._sleep`), then times one call on the host: a call
that returns in microseconds does not wait; one that takes ~200 ms waits for the queue to drain.

    python bench/gpu_sync_probe.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def _cycles_for(ms: float) -> int:
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    per_ms = 10_000_000 / (1e3 * (time.perf_counter() - t))
    return int(per_ms * ms)


def probe(name: str, cycles: int, fn: Callable[[], object]) -> dict[str, float | str]:
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t = time.perf_counter()
    fn()
    host_ms = 1e3 * (time.perf_counter() - t)
    torch.cuda.synchronize()
    return {"probe": name, "host_ms": host_ms}


def main(out_dir: str) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    cycles = _cycles_for(200.0)
    sizes = iter(range(1, 1_000))
    keep: list[torch.Tensor] = []

    def new_pinned() -> None:   # a size the caching host allocator has not seen: cudaHostAlloc
        keep.append(torch.empty((next(sizes) * 1_048_576 + 12_345,), dtype=torch.uint8).pin_memory())

    def cached_pinned() -> None:
        torch.empty((4096,), dtype=torch.uint8).pin_memory()

    def new_device_block() -> None:   # a new segment: cudaMalloc
        keep.append(torch.empty((next(sizes) * 64 * 1_048_576 + 7,), dtype=torch.uint8, device="cuda"))

    def pageable_copy() -> None:
        torch.ones(1024).to("cuda")

    def pinned_copy() -> None:
        torch.ones(1024).pin_memory().to("cuda", non_blocking=True)

    weight = torch.zeros(128256, 4096, dtype=torch.bfloat16, device="cuda")   # Llama-3.1-8B's lm_head
    hidden = torch.zeros(1024, 4096, dtype=torch.bfloat16, device="cuda")

    def logits(m: int) -> Callable[[], object]:   # cuBLAS picks a kernel by row count: lazily loaded on first use
        return lambda: torch.nn.functional.linear(hidden[:m], weight).float()

    cached_pinned()
    rows = [probe("sleep only (reference)", cycles, lambda: None)]
    for m in (1, 37, 300, 859, 1024):
        rows += [probe(f"logits matmul, {m} rows", cycles, logits(m)) for _ in range(2)]
    for name, fn in [("pin_memory, new size (cudaHostAlloc)", new_pinned), ("pin_memory, cached size", cached_pinned),
                     ("device tensor, new segment (cudaMalloc)", new_device_block),
                     ("pageable host-to-device copy", pageable_copy), ("pinned non-blocking copy", pinned_copy)]:
        rows += [probe(name, cycles, fn) for _ in range(2)]
    keep.clear()
    torch.cuda.synchronize()
    rows.append(probe("empty_cache (cudaFree)", cycles, torch.cuda.empty_cache))
    text = "\n".join(f"{r['probe']:45s} host {float(r['host_ms']):8.2f} ms (GPU queue ~200 ms)" for r in rows)
    print(text)
    Path(out_dir, "sync_probe.txt").write_text(text + "\n")
    Path(out_dir, "sync_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
