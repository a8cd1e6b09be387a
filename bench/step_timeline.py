"""Two step timelines of the same work side by side (`KVFLEET_STEP_TIMELINE`, kvfleet.engine.step_timeline).

    python bench/step_timeline.py compare ONLINE.jsonl OFFLINE.jsonl [--json OUT.json]

Issue 16's 300-at-once row: online, a request waits ~7 % longer for its first step than the same 300 prompts do in
process. Each file's busiest period (the one with the most prompt tokens; warm-up steps come before it, apart by
an idle gap) is summed up: how long until the last prompt started, the steps in that phase (their count, the time
from one step's start to the next, the part of it inside `step()` and the part outside it: the server's step loop
taking requests in and handing outputs over), how many calls the intake of the requests spanned, and the first steps
one by one (how fast the intake filled them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kvfleet.engine.step_timeline import StepRecord, read_timeline

IDLE_GAP_S = 0.5   # a gap this long between two calls ends a busy period


def busy_periods(records: list[StepRecord], gap_s: float = IDLE_GAP_S) -> list[list[StepRecord]]:
    """Split where the engine went idle: a gap of `gap_s` between calls, or a call that left nothing waiting or
    running (the offline benchmark's short run before the timed one ends so, with no gap)."""
    periods: list[list[StepRecord]] = []
    for rec in records:
        if periods:
            last = periods[-1][-1]
            drained = last.waiting == 0 and last.running == 0
            if not drained and rec.t - (last.t + last.call_ms / 1e3) <= gap_s:
                periods[-1].append(rec)
                continue
        periods.append([rec])
    return periods


def prompt_tokens(period: list[StepRecord]) -> int:
    return sum(r.launched.prompt_tokens for r in period if r.launched is not None)


def busiest(records: list[StepRecord]) -> list[StepRecord]:
    periods = busy_periods(records)
    if not periods:
        raise ValueError("the timeline has no steps")
    return max(periods, key=prompt_tokens)


@dataclass(frozen=True)
class PhaseSummary:
    steps: int                    # calls of the period
    span_ms: float                # first call's start to last call's end
    prompt_tokens: int
    prompts_started: int
    start_phase_ms: float         # first call's start to the start of the call that launched the last first chunk
    start_phase_steps: int        # calls in that phase
    interval_ms_mean: float       # call start to next call start, in that phase
    in_step_ms_mean: float        # the call's own time, in that phase
    outside_ms_mean: float        # interval less the call: the caller's time between calls
    prompt_tokens_per_step: float  # in that phase
    launched_ahead: int           # steps of that phase launched before the step before's tokens were read
    collect_ms_mean: float        # the calls' wait for the step before's tokens, in that phase (near 0: host-bound)
    requests_added: int           # taken in during the period (before its first call included)
    intake_ms: float              # first call's start to the start of the call after which all of them were in
    intake_steps: int             # calls until then
    first_steps: list[dict[str, float]]   # the first calls: start ms, call ms, prompt tokens, decode rows, waiting
    # On a GPU: the device's time on the steps the calls collected, and its idle time before them (None: no GPU
    # times in the timeline), in the start phase and in the whole period
    start_phase_gpu_busy_ms: Optional[float] = None
    start_phase_gpu_idle_ms: Optional[float] = None
    gpu_busy_ms: Optional[float] = None
    gpu_idle_ms: Optional[float] = None


def gpu_sums(records: list[StepRecord]) -> tuple[Optional[float], Optional[float]]:
    """The device's busy and idle ms over `records` (None where none has GPU times)."""
    busy = [r.gpu_ms for r in records if r.gpu_ms is not None]
    idle = [r.gpu_idle_ms for r in records if r.gpu_idle_ms is not None]
    return (round(sum(busy), 1) if busy else None), (round(sum(idle), 1) if idle else None)


def summarize(period: list[StepRecord], first: int = 8) -> PhaseSummary:
    t0 = period[0].t
    starts = [i for i, r in enumerate(period) if r.launched is not None and r.launched.first_chunks > 0]
    last_start = starts[-1] if starts else 0
    phase = period[: last_start + 1]
    pairs = list(zip(phase, period[1: last_start + 2], strict=False))   # each call of the phase and the next
    intervals = [(b.t - a.t) * 1e3 for a, b in pairs]
    outside = [(b.t - a.t) * 1e3 - a.call_ms for a, b in pairs]
    end = period[-1]
    cumulative = list(itertools.accumulate(r.added for r in period))
    all_in = cumulative.index(cumulative[-1])
    phase_busy, phase_idle = gpu_sums(phase)
    busy, idle = gpu_sums(period)
    return PhaseSummary(
        steps=len(period), span_ms=round((end.t - t0) * 1e3 + end.call_ms, 1),
        prompt_tokens=prompt_tokens(period),
        prompts_started=sum(r.launched.first_chunks for r in period if r.launched is not None),
        start_phase_ms=round((period[last_start].t - t0) * 1e3, 1), start_phase_steps=len(phase),
        interval_ms_mean=round(statistics.fmean(intervals), 3) if intervals else 0.0,
        in_step_ms_mean=round(statistics.fmean(r.call_ms for r in phase), 3),
        outside_ms_mean=round(statistics.fmean(outside), 3) if outside else 0.0,
        prompt_tokens_per_step=round(prompt_tokens(phase) / len(phase), 1),
        launched_ahead=sum(r.ahead for r in phase),
        collect_ms_mean=round(statistics.fmean(r.collect_ms for r in phase), 3),
        requests_added=cumulative[-1], intake_ms=round((period[all_in].t - t0) * 1e3, 1), intake_steps=all_in + 1,
        first_steps=[{"t_ms": round((r.t - t0) * 1e3, 1), "call_ms": r.call_ms,
                      "prompt_tokens": r.launched.prompt_tokens if r.launched else 0,
                      "decode_rows": r.launched.decode_rows if r.launched else 0, "waiting": r.waiting,
                      "added": r.added}
                     for r in period[:first]],
        start_phase_gpu_busy_ms=phase_busy, start_phase_gpu_idle_ms=phase_idle, gpu_busy_ms=busy, gpu_idle_ms=idle)


SUMMARY_ROWS = ("steps", "span_ms", "prompt_tokens", "prompts_started", "start_phase_ms", "start_phase_steps",
                "interval_ms_mean", "in_step_ms_mean", "outside_ms_mean", "prompt_tokens_per_step", "launched_ahead",
                "collect_ms_mean", "requests_added", "intake_ms", "intake_steps", "start_phase_gpu_busy_ms",
                "start_phase_gpu_idle_ms", "gpu_busy_ms", "gpu_idle_ms")


def render(names: list[str], summaries: list[PhaseSummary]) -> str:
    lines = ["| figure | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for row in SUMMARY_ROWS:
        lines.append(f"| {row} | " + " | ".join(str(getattr(s, row)) for s in summaries) + " |")
    for name, s in zip(names, summaries, strict=True):
        lines += ["", f"{name}: the first steps (start ms, call ms, prompt tokens, decode rows, waiting after, "
                  "taken in before)"]
        lines += [f"  {f['t_ms']:9.1f} {f['call_ms']:9.2f} {f['prompt_tokens']:6d} {f['decode_rows']:5d} "
                  f"{f['waiting']:5d} {f['added']:5d}" for f in s.first_steps]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    cmp = sub.add_parser("compare", help="sum up each timeline's busiest period, side by side")
    cmp.add_argument("timelines", nargs="+", type=Path)
    cmp.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    args = ap.parse_args(argv)
    names = [p.stem for p in args.timelines]
    summaries = [summarize(busiest(read_timeline(str(p)))) for p in args.timelines]
    sys.stdout.write(render(names, summaries))
    if args.json is not None:
        args.json.write_text(json.dumps({n: asdict(s) for n, s in zip(names, summaries, strict=True)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
