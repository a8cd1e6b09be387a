"""Bucket planning of the decode CUDA graphs (the capture itself needs a GPU: bench/gpu_run.py)."""

import pytest
import torch

from kvfleet.engine.cuda_graphs import CudaGraphRunner, build_graph_runner, graph_batch_sizes, pick_bucket


def test_batch_sizes_cover_every_batch_up_to_the_max() -> None:
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 20
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    for n in range(1, 257):
        b = pick_bucket(sizes, n)
        assert b is not None and n <= b and b - n < 16
    assert pick_bucket(sizes, 257) is None
    big = graph_batch_sizes(1024)
    assert len(big) == 36 and big[-1] == 1024 and 288 in big and 576 in big
    for n in range(1, 1025):
        b = pick_bucket(big, n)
        assert b is not None and n <= b and b - n < max(16, 0.12 * b)


def test_bad_sizes_and_devices_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="device"):
        CudaGraphRunner(None, [], 4, 64, 16, torch.device("cpu"))
    assert build_graph_runner(None, [], 4, 64, 16, torch.device("cpu")) is None
