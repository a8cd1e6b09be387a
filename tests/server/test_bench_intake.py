"""bench/http_intake.py runs against the server's real intake code (it broke once, unnoticed, when the server's
engine handle became a typed AsyncLLM): a tiny run, every part measured."""

import json
from pathlib import Path
from typing import Any, Callable


def test_http_intake_harness_measures_every_part(tmp_path: Path, bench_module: Callable[[str], Any]) -> None:
    module = bench_module("http_intake")
    out = tmp_path / "intake.json"
    assert module.main(["--lengths", "16", "--requests", "3", "--rounds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["us_per_request"]
    assert set(rows) == {"no tokenizer, 16 tokens", "tokenizer, 16 tokens"}
    for row in rows.values():
        assert all(row[part] > 0 for part in module.PARTS), row
        assert abs(row["event_loop"] - row["parse"] - row["handler"]) < 1e-6
