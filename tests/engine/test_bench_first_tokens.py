"""bench/first_tokens.py: the first tokens of a burst, a late start told from slower work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest


def _burst(start_ms: float, step_ms: float, per_step: int, n: int) -> list[dict[str, float | None]]:
    """n requests sent over the first 10 ms; their first tokens a step's `per_step` at a time."""
    out = []
    for i in range(n):
        sent = i * 10 / n / 1e3
        first = (start_ms + (i // per_step + 1) * step_ms) / 1e3
        out.append({"sent_s": sent, "first_token_s": first, "ttft_ms": (first - sent) * 1e3, "e2e_ms": 1000.0})
    return out


def test_a_late_start_moves_the_intercept_slower_steps_the_slope(bench_module: Callable[[str], Any],
                                                                   tmp_path: Path) -> None:
    ft = bench_module("first_tokens")
    base = ft.summarize(_burst(0.0, 190.0, 8, 300))
    late = ft.summarize(_burst(200.0, 190.0, 8, 300))
    slow = ft.summarize(_burst(0.0, 200.0, 8, 300))
    assert base.requests == 300 and base.first_ms == pytest.approx(190.0) and base.last_ms == pytest.approx(38 * 190)
    assert late.intercept_ms - base.intercept_ms == pytest.approx(200.0, abs=0.01)
    assert late.slope_ms == pytest.approx(base.slope_ms)
    assert slow.slope_ms / base.slope_ms == pytest.approx(200 / 190, rel=1e-3)
    assert base.slope_ms == pytest.approx(190 / 8, rel=0.02)   # the steps' pace: a step's time over its prompts
    assert late.ttft_mean_ms - base.ttft_mean_ms == pytest.approx(200.0)

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"per_request": _burst(0.0, 190.0, 8, 300)}))
    b.write_text(json.dumps({"per_request": _burst(200.0, 190.0, 8, 300)}))
    out = tmp_path / "out.json"
    assert ft.main(["compare", str(a), str(b), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["b"]["first_ms"] == pytest.approx(390.0)


def test_runs_without_first_tokens_are_a_clear_error(bench_module: Callable[[str], Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ft = bench_module("first_tokens")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"ttft_ms": {"p50": 1.0}}))
    assert ft.main(["compare", str(old)]) == 2
    assert "no per_request list" in capsys.readouterr().err
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"per_request": _burst(0.0, 190.0, 8, 16)}))
    assert ft.main(["compare", str(old), str(new)]) == 0   # the old run left out, the new one summed up
    out = capsys.readouterr()
    assert "skipped" in out.err and "| new |" in out.out and "| old" not in out.out
    with pytest.raises(ValueError, match="per_request: needs two"):
        ft.summarize([{"sent_s": 0.0, "first_token_s": None, "ttft_ms": None, "e2e_ms": 5.0}])
