"""Time one decode step of a loaded engine at a fixed batch and context, against its bandwidth floor.

The floor is the bytes a decode step must read (every weight once, except an
untied embedding table; the K and V of every context token of every layer) over
the measured copy bandwidth. A roofline figure is given too: KV bytes over
bandwidth plus, for the matmuls, the larger of their bytes over bandwidth and
their FLOPs over the measured bf16 matmul rate (at batch 256 an 8B model's
matmuls are compute-bound on an H200). The
step is the model forward (a CUDA-graph replay when captured) plus the LM head
on every row, timed with CUDA events (median).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfleet.engine.attention.metadata import build_attention_metadata


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    return 2 * nbytes / (median_cuda_ms(lambda: y.copy_(x), 20) / 1e3)


def capture_graph(fn: Any) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after two warm-up calls on a side stream (first-use compiles and
    allocations stay out of the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def median_cuda_ms(fn: Any, iters: int) -> float:
    """Median time of `fn` in ms over `iters` runs, by CUDA events, after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def ms_per_call(calls: list[Callable[[], Any]], device: torch.device, iters: int) -> tuple[float, bool]:
    """(ms per call, whether a CUDA graph ran them): the calls once each in a graph, the graph's median over the
    calls (launch gaps out of the figure, as in the engine's captured steps). Not capturable: eager, and says so.
    On CPU (the kernel sweeps' dry runs): one eager pass, timed by the clock."""
    if device.type != "cuda":
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls), False
    for c in calls:   # compiles, library heuristics and workspaces before capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly, and say so
        torch.cuda.synchronize()
        return median_cuda_ms(lambda: [c() for c in calls], iters) / len(calls), False
    torch.cuda.current_stream().wait_stream(stream)
    ms = median_cuda_ms(graph.replay, iters) / len(calls)
    del graph
    return ms, True


def probe_decode_step(engine: Any, batch: int, ctx: int, iters: int = 20) -> dict[str, Any]:
    runner = engine.runner
    cfg = runner.model_config
    block_size = runner.block_size
    device = runner.device
    per_seq = math.ceil(ctx / block_size)
    num_blocks = runner.kv_caches[0].shape[1]
    if batch * per_seq > num_blocks:
        return {"error": f"needs {batch * per_seq} KV blocks, pool has {num_blocks}"}
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    md = build_attention_metadata([1] * batch, [ctx] * batch, tables, block_size, device)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device)
    pos = torch.full((batch,), ctx - 1, dtype=torch.long, device=device)
    executor = runner.executor
    rows = list(range(batch))

    def step() -> None:   # as the engine's steps run it (a graph replay when one fits)
        with torch.inference_mode():
            executor.compute_logits(executor.forward(ids, pos, runner.kv_caches, md, rows))

    def eager() -> None:
        with torch.inference_mode():
            executor.compute_logits(executor.forward(ids, pos, runner.kv_caches, md, rows, eager=True))

    ms = median_cuda_ms(step, iters)
    eager_ms = median_cuda_ms(eager, max(5, iters // 4))
    weight_bytes = decode_weight_bytes(executor.model)
    elem = runner.kv_caches[0].element_size()
    # this rank's KV heads: under tensor parallelism each GPU reads its own share (weights likewise)
    kv_bytes = batch * ctx * cfg.num_layers * 2 * runner.num_kv_heads * cfg.head_dim * elem
    bw = copy_bandwidth(device)
    floor_ms = (weight_bytes + kv_bytes) / bw * 1e3
    used_graph = executor.graphs is not None and executor.graphs.can_run(batch, md)
    # roofline per part: attention reads KV (bandwidth); the matmuls at this batch may be compute-bound
    flops = 2 * (weight_bytes / runner.kv_caches[0].element_size()) * batch
    peak = matmul_rate(device)
    roofline_ms = (kv_bytes / bw + max(weight_bytes / bw, flops / peak)) * 1e3
    return {"batch": batch, "ctx": ctx, "step_ms": ms, "eager_step_ms": eager_ms, "cuda_graph": used_graph,
            "weight_GB": weight_bytes / 1e9, "kv_read_GB": kv_bytes / 1e9, "copy_bw_GBps": bw / 1e9,
            "floor_ms": floor_ms, "x_floor": ms / floor_ms, "matmul_TFLOPs": peak / 1e12,
            "roofline_ms": roofline_ms, "x_roofline": ms / roofline_ms}


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads: every parameter once, except an untied input
    embedding table, of which a step reads only its batch's rows."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    total = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if "embed_tokens" in name and (head is None or head.data_ptr() != p.data_ptr()):
            continue
        total += p.numel() * p.element_size()
    return total


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """Measured bf16 matmul FLOP/s on random data."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / (median_cuda_ms(lambda: a @ b, 10) / 1e3)
