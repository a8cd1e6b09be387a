"""Bucket planning of the decode CUDA graphs (the capture itself needs a GPU:
tests/engine/test_cuda_graphs_gpu.py, bench/gpu_run.py)."""

import pytest
import torch

from kvfleet.engine.cuda_graphs import (
    CudaGraphRunner,
    build_graph_runner,
    graph_batch_sizes,
    pick_bucket,
    short_context_sizes,
)


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


def test_short_context_graphs_only_where_the_long_split_changes_the_launch() -> None:
    """KVFLEET_DECODE_LONG_SPLIT = L: a size the batch alone leaves at one split launches two for contexts that may
    exceed L keys; it gets a second graph for contexts of up to L (one split). Smaller batches split by the batch
    rule either way, so theirs would be the same launch."""
    sizes = graph_batch_sizes(256)
    assert short_context_sizes(sizes, 8, 8448, 132, 0) == []          # the knob off
    assert short_context_sizes(sizes, 8, 2048, 132, 2048) == []       # no context can exceed it
    # 8 KV heads on 132 SMs: from 33 sequences on, the batch alone gives one split
    assert short_context_sizes(sizes, 8, 8448, 132, 2048) == [s for s in sizes if s >= 33]
    assert short_context_sizes(sizes, 2, 8448, 132, 2048) == [s for s in sizes if s >= 132]

