"""The direct NCCL binding (kvfleet.engine.distributed.nccl): what runs without a GPU here, the
all-reduce itself on two GPUs (eager and captured in a CUDA graph)."""

from __future__ import annotations

import os

import pytest
import torch

from kvfleet.engine.distributed import nccl


@pytest.fixture(scope="module")
def lib() -> nccl.NcclLibrary:
    try:
        return nccl.NcclLibrary()
    except nccl.NcclError as exc:
        # the project's torch (PyPI) ships libnccl, so in CI a missing one is a failure; only a CPU-only
        # torch build installed by hand lacks it
        if os.environ.get("CI"):
            pytest.fail(f"PyTorch's libnccl not found: {exc}")
        pytest.skip(str(exc))


def test_library_is_pytorchs_own_and_draws_unique_ids(lib: nccl.NcclLibrary, monkeypatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    assert lib.version() == ".".join(map(str, torch.cuda.nccl.version()))
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == nccl.NCCL_UNIQUE_ID_BYTES and a != b


def test_a_missing_library_and_bad_arguments_are_clear_errors(lib: nccl.NcclLibrary) -> None:
    with pytest.raises(nccl.NcclError, match="/nowhere/libnccl.so.*KVFLEET_NCCL_LIBRARY|KVFLEET_NCCL_LIBRARY.*nowhere"):
        nccl.NcclLibrary("/nowhere/libnccl.so")
    with pytest.raises(nccl.NcclError, match="ncclGetVersion failed: .*ncclResult 2"):
        lib.check(2, "ncclGetVersion")
    with pytest.raises(ValueError, match="unique_id: 128 bytes"):
        nccl.NcclCommunicator(lib, b"short", 0, 2, torch.device("cuda", 0))


def test_the_all_reduce_choice_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("KVFLEET_TP_ALLREDUCE", raising=False)
    assert nccl.use_direct_nccl() is False   # torch.distributed: measured faster end to end
    monkeypatch.setenv("KVFLEET_TP_ALLREDUCE", "torch")
    assert nccl.use_direct_nccl() is False
    monkeypatch.setenv("KVFLEET_TP_ALLREDUCE", "nccl")
    assert nccl.use_direct_nccl() is True
    monkeypatch.setenv("KVFLEET_TP_ALLREDUCE", "mpi")
    with pytest.raises(ValueError, match="KVFLEET_TP_ALLREDUCE"):
        nccl.use_direct_nccl()


def _rank(rank: int, port: int, queue) -> None:  # noqa: ANN001
    """One rank: tensor-parallel all-reduces through the direct communicator, eager then replayed."""
    import os

    import torch.distributed as dist

    from kvfleet.engine.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel, tp_all_reduce

    os.environ["KVFLEET_TP_ALLREDUCE"] = "nccl"
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", device=dev, timeout_s=60)
    x = torch.full((256, 4096), float(rank + 1), dtype=torch.bfloat16, device=dev)
    tp_all_reduce(x)
    torch.cuda.synchronize()
    eager_ok = bool((x == 3).all())
    y = torch.ones(1024, dtype=torch.float32, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        tp_all_reduce(y)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            tp_all_reduce(y)
    y.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    queue.put((rank, eager_ok, bool((y == 8).all())))
    dist.barrier()
    del graph  # NCCL's destroy waits for every graph that captured the communicator
    destroy_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.timeout(120, method="thread")
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_direct_all_reduce_eager_and_in_a_cuda_graph() -> None:
    import multiprocessing as mp

    from kvfleet.engine.distributed.executor import free_loopback_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, True, True), (1, True, True)]
