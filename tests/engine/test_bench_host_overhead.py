"""bench/host_overhead.py drives the real engine with a stand-in forward (it broke once, unnoticed, when the
executor's forward gained a keyword option): a tiny run, every part of every step kind measured."""

import json
from pathlib import Path
from typing import Any, Callable

import torch


def test_host_overhead_harness_measures_every_part(tmp_path: Path, bench_module: Callable[[str], Any]) -> None:
    threads = torch.get_num_threads()   # the harness runs torch on one thread: not the rest of the session
    try:
        module = bench_module("host_overhead")
        assert module.main(["--label", "tiny", "--batches", "8", "--steps", "3", "--out-dir", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    (run,) = json.loads((tmp_path / "tiny.json").read_text())["runs"]
    assert run["decode_stream"]["steps"] == run["decode_final"]["steps"] == 3
    assert run["mixed_stream"]["steps"] >= 1 and run["mixed_stream"]["mean_batch"] > 8   # new prompts joined
    for mode in ("decode_stream", "decode_final", "mixed_stream"):
        assert all(run[mode][f"{part}_ms"] > 0 for part in module.PARTS), run[mode]
