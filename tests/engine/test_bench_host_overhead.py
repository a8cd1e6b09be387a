"""bench/host_overhead.py drives the real engine with a stand-in forward (it broke once, unnoticed, when the
executor's forward gained a keyword option): a tiny run, every part of every step kind measured."""

import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_harness_measures_every_part(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "bench" / "host_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["host_overhead"] = module
    threads = torch.get_num_threads()   # the harness runs torch on one thread: not the rest of the session
    try:
        spec.loader.exec_module(module)
        assert module.main(["--label", "tiny", "--batches", "8", "--steps", "3", "--out-dir", str(tmp_path)]) == 0
    finally:
        sys.modules.pop("host_overhead", None)
        torch.set_num_threads(threads)
    (run,) = json.loads((tmp_path / "tiny.json").read_text())["runs"]
    assert run["decode_stream"]["steps"] == run["decode_final"]["steps"] == 3
    assert run["mixed_stream"]["steps"] >= 1 and run["mixed_stream"]["mean_batch"] > 8   # new prompts joined
    for mode in ("decode_stream", "decode_final", "mixed_stream"):
        assert all(run[mode][f"{part}_ms"] > 0 for part in module.PARTS), run[mode]
