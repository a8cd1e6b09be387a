"""Two-GPU communication check for tensor parallelism, apart from the engine: can the GPUs reach each
other (peer access, `nvidia-smi topo`), how long an NCCL all-reduce of a decode step's activations takes
(eager, median of 50), and whether the same all-reduce captured in a CUDA graph completes when replayed.
Each rank arms a stack dump (faulthandler) so a hang shows where it waits. On CPU it runs the eager
part over gloo (no graphs). Usage: python bench/gpu_tp_diag.py OUT.json"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS, HIDDEN = 256, 4096      # one decode step of Llama-3.1-8B at batch 256: 2 MiB of bf16
HANG_S = 40.0


def _timed(fn: Any, iters: int, cuda: bool) -> float:
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, port: int, cuda: bool, queue: Any) -> None:
    faulthandler.dump_traceback_later(HANG_S, repeat=True, file=sys.stderr)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # rendezvous and bootstrap on loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    res: dict[str, Any] = {"rank": rank}
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.ones(ROWS, HIDDEN, dtype=dtype, device=dev)
    dist.all_reduce(x)
    res["sum_ok"] = bool((x == 2).all())
    res["eager_allreduce_ms"] = _timed(lambda: dist.all_reduce(x), 50, cuda)
    # Host time per call, not waiting for the GPU: what an eager TP forward pays per all-reduce
    # (64 per Llama-8B step); through the Python API and straight on the process group.
    pg = dist.distributed_c10d._get_default_group()
    for name, call in (("api", lambda: dist.all_reduce(x)), ("process_group", lambda: pg.allreduce([x]))):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            call()
        res[f"host_us_per_allreduce_{name}"] = (time.perf_counter() - t) / 200 * 1e6
        if cuda:
            torch.cuda.synchronize()
    if cuda:  # the direct NCCL binding (kvfleet.engine.distributed.nccl): same measurements
        from kvfleet.engine.distributed.nccl import make_communicator

        control = dist.new_group(backend="gloo")

        def share(obj: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=control)
            return box[0]

        try:
            comm = make_communicator(rank, 2, dev, share)
            z = torch.ones(ROWS, HIDDEN, dtype=dtype, device=dev)
            comm.all_reduce(z)
            torch.cuda.synchronize()
            res["direct_sum_ok"] = bool((z == 2).all())
            res["direct_allreduce_ms"] = _timed(lambda: comm.all_reduce(z), 50, cuda)
            t = time.perf_counter()
            for _ in range(200):
                comm.all_reduce(z)
            res["host_us_per_allreduce_direct"] = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
        except Exception as exc:
            res["direct_error"] = repr(exc)[:500]
    if cuda:
        y = torch.ones(ROWS, HIDDEN, dtype=dtype, device=dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            dist.all_reduce(y)
        torch.cuda.current_stream(dev).wait_stream(s)
        torch.cuda.synchronize()
        res["stage"] = "capturing"
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(10):
                    dist.all_reduce(y)
            res["captured"] = True
            y.fill_(1.0)
            graph.replay()
            torch.cuda.synchronize()
            res["graph_sum_ok"] = bool((y == 2 ** 10).all())
            res["graph_10_allreduce_ms"] = _timed(graph.replay, 20, cuda)
            dist.all_reduce(x)   # eager after graph replays, on the same communicator
            torch.cuda.synchronize()
            res["eager_after_graph_ok"] = True
        except Exception as exc:  # reported, not raised: the peer may be waiting in a collective
            res["graph_error"] = repr(exc)[:500]
    queue.put(res)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    out = argv[1] if len(argv) > 1 else "tp_diag.json"
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    info: dict[str, Any] = {"cuda": cuda, "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    if cuda:
        info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
        try:
            info["topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                          timeout=20).stdout
        except Exception as exc:
            info["topo"] = repr(exc)
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    from kvfleet.engine.distributed.executor import free_loopback_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=_rank, args=(r, port, cuda, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = []
    try:
        for _ in procs:
            ranks.append(queue.get(timeout=150))
    except Exception as exc:
        info["error"] = f"a rank did not report in 150 s: {exc!r}"
    for p in procs:
        p.join(10)
        if p.exitcode is None:
            p.kill()
    info["ranks"] = sorted(ranks, key=lambda r: r["rank"])
    with open(out, "w") as f:
        json.dump(info, f, indent=1)
    print(f"peer access: {info.get('peer_access_0_1')}  nccl {info.get('nccl_version')}")
    for r in info["ranks"]:
        print("  rank {rank}: sum ok {sum_ok}, eager all-reduce {eager_allreduce_ms:.3f} ms".format(**r),
              {k: v for k, v in r.items() if k not in ("rank", "sum_ok", "eager_allreduce_ms")})
    if "error" in info:
        print("  " + info["error"])
    return 0 if len(ranks) == 2 and "error" not in info else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
