"""Offline runs phase by phase: the step trace (kvfleet.engine.bench.step_trace) and bench/offline_phases.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from kvfleet.engine.bench.step_trace import RequestClock, StepTrace, phase_summary
from kvfleet.engine.bench.vllm_backend import traced_get_output


def _run(prefill_steps: int, prefill_ms: float, tail_ms: Callable[[int], float], batch: int) -> StepTrace:
    """`batch` requests started `batch // prefill_steps` a step, then decoded until one is left, a request
    finishing every step (so the tail's batch shrinks by one a step)."""
    tr = StepTrace()
    t = 0.0
    per = batch // prefill_steps
    for i in range(prefill_steps):
        t += prefill_ms / 1e3
        tr.add_step(t, per * (i + 1))
        tr.first_token_s += [t] * per
    for running in range(batch, 0, -1):
        t += tail_ms(running) / 1e3
        tr.add_step(t, running)
        tr.finished_s.append(t)
    return tr


def test_the_summary_splits_the_prefill_phase_from_the_tail_and_bins_the_tail_by_batch() -> None:
    s = phase_summary(_run(4, 300.0, lambda b: 5.0 + b / 100, 64))
    assert s.steps == 4 + 64 and s.prefill_steps == 4 and s.prefill_end_s == pytest.approx(1.2)
    assert s.tail_steps == 64 and s.tail_s == pytest.approx(s.end_s - s.prefill_end_s)
    by = {b.lo: b for b in s.tail_bins}
    assert sorted(by) == [1, 8, 16, 32, 64] and sum(b.steps for b in s.tail_bins) == 64
    assert by[64].steps == 1 and by[32].steps == 32 and by[1].steps == 7
    assert by[1].median_ms == pytest.approx(5.04) and by[32].median_ms == pytest.approx(5.0 + 47.5 / 100)


def test_an_empty_trace_is_an_error_not_a_summary() -> None:
    with pytest.raises(ValueError, match="empty step trace"):
        phase_summary(StepTrace())


def test_calls_without_tokens_are_not_steps_and_the_json_round_trips() -> None:
    tr = _run(2, 100.0, lambda b: 10.0, 4)
    tr.add_step(9.0, 0)
    back = StepTrace.from_json(json.loads(json.dumps(tr.to_json())))
    assert back.t_s == pytest.approx(tr.t_s) and back.tokens == tr.tokens and len(back.t_s) == 2 + 4
    a, b = phase_summary(back), phase_summary(tr)
    assert (a.prefill_steps, a.tail_steps, a.end_s) == (b.prefill_steps, b.tail_steps, pytest.approx(b.end_s))


@dataclass
class _CoreOutput:            # the fields of vLLM 0.26.0's EngineCoreOutput the trace reads
    request_id: str
    new_token_ids: list[int]
    finish_reason: Any = None


@dataclass
class _CoreOutputs:           # and of EngineCoreOutputs
    outputs: list[_CoreOutput] = field(default_factory=list)


def test_vllm_steps_are_read_from_the_engine_core_client_and_passed_through() -> None:
    steps = iter([_CoreOutputs([_CoreOutput("a", [1]), _CoreOutput("b", [])]),
                  _CoreOutputs([]),
                  _CoreOutputs([_CoreOutput("a", [2], "length"), _CoreOutput("b", [3])]),
                  _CoreOutputs([_CoreOutput("b", [4, 5], "length")])])
    tr = StepTrace()
    get = traced_get_output(lambda: next(steps), tr, t0=0.0)
    got = [get() for _ in range(4)]
    assert [len(g.outputs) for g in got] == [2, 0, 2, 1]     # each step handed on as it came
    assert tr.tokens == [1, 2, 2] and len(tr.t_s) == 3        # the empty poll is no step
    assert len(tr.first_token_s) == 2 and len(tr.finished_s) == 2
    assert tr.t_s == sorted(tr.t_s)


def test_a_request_has_one_first_token_and_one_finish() -> None:
    tr = StepTrace()
    clock = RequestClock(tr)
    for t, rid, fin in [(1.0, "x", False), (2.0, "x", False), (3.0, "y", False), (4.0, "x", True)]:
        clock.observe(t, rid, fin)
    assert tr.first_token_s == [1.0, 3.0] and tr.finished_s == [4.0]


def test_compare_puts_two_runs_side_by_side(bench_module: Callable[[str], Any], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Equal prefill phases, a tail 10 % slower in B: the prefill row's ratio is 1, the tail's bins say 1.1."""
    op = bench_module("offline_phases")
    for name, k in (("a", 1.0), ("b", 1.1)):
        trace = _run(4, 300.0, lambda b, k=k: k * (5.0 + b / 100), 64).to_json()
        (tmp_path / f"{name}.json").write_text(json.dumps({"backend": name, "workload": "w", "step_trace": trace}))
    assert op.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                    "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "| prefill phase s (to the last first token) | 1.200 | 1.200 | 1.000 |" in out
    bin32 = next(line for line in out.splitlines() if line.startswith("| 32-63 |"))
    assert bin32.startswith("| 32-63 | 32 | 32 |") and "| 1.100 |" in bin32
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["b"]["tail_s"] == pytest.approx(1.1 * doc["a"]["tail_s"])
    (tmp_path / "c.json").write_text(json.dumps({"backend": "c"}))
    with pytest.raises(SystemExit, match="no step_trace"):
        op.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")])
