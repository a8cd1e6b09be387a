"""bench/gpu_penalties.py on a CPU at a small vocabulary: both penalty forms run on its batches, agree, and the
JSON holds every (batch, penalties) row."""

import json
from pathlib import Path
from typing import Any, Callable


def test_penalties_bench_times_both_forms_and_checks_them_equal(tmp_path: Path,
                                                                bench_module: Callable[[str], Any]) -> None:
    module = bench_module("gpu_penalties")
    assert module.main([str(tmp_path), "--device", "cpu", "--batches", "3,8", "--vocab", "300",
                        "--prompt-len", "20", "--output-len", "6", "--rounds", "2"]) == 0
    report = json.loads((tmp_path / "penalties.json").read_text())
    assert report["all_equal"] is True
    rows = report["rows"]
    assert [(r["batch"], r["penalties"]) for r in rows] == [
        (3, "repetition"), (3, "repetition, frequency, presence"), (8, "repetition"),
        (8, "repetition, frequency, presence")]
    assert all(r["columns_ms"] > 0 and r["dense_ms"] > 0 and r["prompt_width"] > 0 for r in rows)
    assert len((tmp_path / "penalties.txt").read_text().splitlines()) == 5
