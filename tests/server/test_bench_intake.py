"""bench/http_intake.py runs against the server's real intake code (it broke once, unnoticed, when the server's
engine handle became a typed AsyncLLM): a tiny run, every part measured."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_http_intake_harness_measures_every_part(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("http_intake", ROOT / "bench" / "http_intake.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["http_intake"] = module
    try:
        spec.loader.exec_module(module)
        out = tmp_path / "intake.json"
        assert module.main(["--lengths", "16", "--requests", "3", "--rounds", "1", "--out", str(out)]) == 0
    finally:
        sys.modules.pop("http_intake", None)
    rows = json.loads(out.read_text())["us_per_request"]
    assert set(rows) == {"no tokenizer, 16 tokens", "tokenizer, 16 tokens"}
    for row in rows.values():
        assert all(row[part] > 0 for part in module.PARTS), row
        assert abs(row["event_loop"] - row["parse"] - row["handler"]) < 1e-6
