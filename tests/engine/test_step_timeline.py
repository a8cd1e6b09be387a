"""The engine's step timeline (`KVFLEET_STEP_TIMELINE`) and bench/step_timeline.py, which sums two of them up."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.step_timeline import ENV_VAR, StepRecord, StepShape, StepTimeline, read_timeline
from kvfleet.engine.warmup import ONE_STEP_PLAN

PROMPTS = [list(range(1, 41)), list(range(3, 73)), list(range(5, 25))]   # 40, 70 and 20 tokens
MAX_TOKENS = 4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_timeline_holds_every_prompt_token_and_decode_row(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool) -> None:
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    llm = LLM(str(tiny_model_dir), num_kv_blocks=96, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    llm.llm_engine.warm_up(ONE_STEP_PLAN)   # not in the timeline: it is of the work
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    records = read_timeline(str(path))
    shapes = [r.launched for r in records if r.launched is not None]
    assert sum(s.prompt_tokens for s in shapes) == sum(map(len, PROMPTS))
    assert sum(s.first_chunks for s in shapes) == len(PROMPTS)
    # the first token comes from the prompt's last chunk; each further one from a decode row
    assert sum(s.decode_rows for s in shapes) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert max(s.prompt_tokens + s.decode_rows for s in shapes) <= 64   # the token budget
    assert all(r.call_ms >= 0 for r in records)
    assert [r.t for r in records] == sorted(r.t for r in records)
    assert sum(r.outputs for r in records) >= len(PROMPTS)
    assert sum(r.added for r in records) == len(PROMPTS) and records[0].added == len(PROMPTS)   # all before the first
    assert records[-1].waiting == 0 and records[-1].running == 0
    # the first step has none before it to run ahead of; with async scheduling (no penalty, no grammar) the others do
    launched = [r for r in records if r.launched is not None]
    assert not launched[0].ahead
    assert all(r.ahead for r in launched[1:]) if async_scheduling else not any(r.ahead for r in launched)
    assert all(r.collect_ms >= 0 for r in records) and (async_scheduling or not any(r.collect_ms for r in records))
    assert all(r.collect_ms <= r.call_ms for r in records)
    assert all(r.gpu_ms is None and r.gpu_idle_ms is None for r in records)   # the device's times: a GPU's only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_timeline_holds_each_steps_device_time(tiny_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each collected step's device time (its events' span) and the idle time before it: present from the second
    step read on, within the calls' wall time, and none from the warm-up."""
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=96, max_num_batched_tokens=64,
              async_scheduling=True)
    llm.llm_engine.warm_up(ONE_STEP_PLAN)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                 SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    records = read_timeline(str(path))
    timed = [r for r in records if r.gpu_ms is not None]
    steps = sum(r.launched is not None for r in records)
    # every launched step is read once; the last one's (discarded work) in the same call as the one before it
    assert steps - 1 <= len(timed) <= steps and all(r.gpu_ms > 0 for r in timed)
    assert timed[0].gpu_idle_ms is None and all(r.gpu_idle_ms is not None and r.gpu_idle_ms >= 0 for r in timed[1:])
    span_ms = (records[-1].t - records[0].t) * 1e3 + records[-1].call_ms
    assert sum(r.gpu_ms for r in timed) + sum(r.gpu_idle_ms or 0.0 for r in timed) <= span_ms


def test_no_timeline_unless_asked(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=96, max_num_batched_tokens=64)
    assert llm.llm_engine.timeline is None
    assert StepTimeline.from_env({ENV_VAR: "  "}) is None


def test_a_timeline_file_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^{ENV_VAR}: cannot write .*no-such-dir.*No such file or directory"):
        StepTimeline.from_env({ENV_VAR: str(tmp_path / "no-such-dir" / "t.jsonl")})


def _rec(t: float, call_ms: float, prompt: int = 0, decode: int = 0, first: int = 0, waiting: int = 0,
         running: int = 1, added: int = 0, ahead: bool = False, collect_ms: float = 0.0,
         gpu_ms: float | None = None, gpu_idle_ms: float | None = None) -> StepRecord:
    shape = StepShape(prompt, decode, first) if prompt or decode else None
    return StepRecord(t, call_ms, shape, ahead, collect_ms, waiting, running, 0, added, gpu_ms, gpu_idle_ms)


def test_the_summary_of_the_busiest_period(bench_module: Callable[[str], Any], tmp_path: Path) -> None:
    tl = bench_module("step_timeline")
    warmup = [_rec(0.0, 5.0, prompt=10, first=1), _rec(0.01, 5.0, decode=1, running=0)]
    # a short run that drains the engine, then the burst at once (no idle gap): two periods all the same
    pre = [_rec(1.0, 5.0, prompt=50, first=1), _rec(1.005, 5.0, decode=1, running=0)]
    burst = [_rec(1.01, 10.0, prompt=100, first=1, waiting=5, added=1),     # the intake: one prompt at first
             _rec(1.03, 30.0, prompt=300, decode=1, first=3, waiting=2, added=4, ahead=True, collect_ms=6.0),
             _rec(1.07, 30.0, prompt=200, decode=4, first=2, added=1, ahead=True, collect_ms=24.0),   # the last start
             _rec(1.11, 8.0, decode=6, running=0)]
    periods = tl.busy_periods(warmup + pre + burst)
    assert [len(p) for p in periods] == [2, 2, 4]
    assert tl.busiest(warmup + pre + burst) == burst
    assert [len(p) for p in tl.busy_periods(warmup[:1] + [_rec(0.6, 1.0, decode=1)])] == [1, 1]   # an idle gap
    s = tl.summarize(burst)
    assert (s.steps, s.prompt_tokens, s.prompts_started, s.start_phase_steps) == (4, 600, 6, 3)
    assert s.span_ms == pytest.approx(108.0)
    assert s.start_phase_ms == pytest.approx(60.0)
    assert s.interval_ms_mean == pytest.approx((20 + 40 + 40) / 3, abs=1e-3)   # rounded to µs
    assert s.in_step_ms_mean == pytest.approx((10 + 30 + 30) / 3, abs=1e-3)
    assert s.outside_ms_mean == pytest.approx((10 + 10 + 10) / 3)
    assert s.prompt_tokens_per_step == pytest.approx(200.0)
    assert (s.requests_added, s.intake_steps, s.launched_ahead) == (6, 3, 2)
    assert s.collect_ms_mean == pytest.approx(10.0)
    assert s.intake_ms == pytest.approx(60.0)
    assert s.first_steps[1] == {"t_ms": 20.0, "call_ms": 30.0, "prompt_tokens": 300, "decode_rows": 1, "waiting": 2,
                                "added": 4}

    online, offline = tmp_path / "online.jsonl", tmp_path / "offline.jsonl"
    online.write_text("".join(r.to_json() + "\n" for r in warmup + burst))
    offline.write_text("".join(r.to_json() + "\n" for r in burst))
    out_json = tmp_path / "summary.json"
    assert tl.main(["compare", str(online), str(offline), "--json", str(out_json)]) == 0
    assert '"start_phase_ms": 60.0' in out_json.read_text()
    assert read_timeline(str(online)) == warmup + burst
    assert s.gpu_busy_ms is None and s.start_phase_gpu_idle_ms is None   # no GPU times in these records


def test_the_summary_sums_the_devices_busy_and_idle_time(bench_module: Callable[[str], Any], tmp_path: Path) -> None:
    tl = bench_module("step_timeline")
    period = [_rec(0.0, 10.0, prompt=100, first=1, added=2),
              _rec(0.02, 30.0, prompt=100, decode=1, first=1, ahead=True, gpu_ms=9.0),
              _rec(0.06, 30.0, decode=2, ahead=True, gpu_ms=28.0, gpu_idle_ms=0.5),
              _rec(0.1, 8.0, decode=2, running=0, gpu_ms=7.0, gpu_idle_ms=1.5)]
    s = tl.summarize(period)
    assert (s.start_phase_gpu_busy_ms, s.start_phase_gpu_idle_ms) == (9.0, None)   # the phase: the first two calls
    assert (s.gpu_busy_ms, s.gpu_idle_ms) == (44.0, 2.0)
    # a line of an older timeline, without the device's times, still reads
    old = '{"t":0.5,"call_ms":1.0,"launched":null,"ahead":false,"collect_ms":0.0,"waiting":0,"running":0,' \
          '"outputs":1,"added":0}\n'
    (tmp_path / "old.jsonl").write_text(old)
    (rec,) = read_timeline(str(tmp_path / "old.jsonl"))
    assert rec.gpu_ms is None and rec.gpu_idle_ms is None and rec.outputs == 1


def test_two_steps_read_in_one_call_add_up() -> None:
    from kvfleet.engine.gpu_step_clock import GpuStepTimes

    assert GpuStepTimes(3.0, None).plus(GpuStepTimes(2.0, 0.5)) == GpuStepTimes(5.0, 0.5)
    assert GpuStepTimes(3.0, 0.25).plus(GpuStepTimes(2.0, 0.5)) == GpuStepTimes(5.0, 0.75)
    assert GpuStepTimes(3.0, None).plus(GpuStepTimes(2.0, None)).idle_before_ms is None
