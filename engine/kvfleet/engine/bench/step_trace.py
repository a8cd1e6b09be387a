"""Each engine step of an offline run as the benchmark's host loop saw it, the same way for kvfleet and vLLM.

An offline row is a prefill phase (steps that start prompts, beside the decodes of those started) and then a decode
tail whose batch shrinks to one. Two engines that differ by 2 % on a row differ somewhere in there; the step profiles
compare chosen shapes, not the run. `--step-trace` records, per step, when its tokens reached the host loop
(seconds from the run's start) and how many tokens it gave (its rows: decodes plus prompts that finished their
prefill), and, per request, when its first token and its last came. Both engines are read at the same place: the
loop that drives them (kvfleet's `LLMEngine.step()`, vLLM's engine-core client `get_output()`), on one clock.

`phase_summary` turns one trace into the figures compared side by side (`bench/offline_phases.py`): how long the
prefill phase ran (until the last first token) and in how many steps, the tail's length, and the steps' time by
batch.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

# Batches binned by powers of two: the tail's small batches are weight-bound, the large ones KV-bound.
BATCH_BINS = ((1, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 1 << 30))


@dataclass
class StepTrace:
    """Per step: when its tokens reached the host loop (s from the run's start) and how many it gave; per request,
    when its first token and its last came (s; the two lists are times, not paired request by request)."""

    t_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    finished_s: list[float] = field(default_factory=list)

    def add_step(self, t_s: float, tokens: int) -> None:
        if tokens > 0:   # a call that returned nothing (vLLM's idle polls, kvfleet's first async launch) is no step
            self.t_s.append(t_s)
            self.tokens.append(tokens)

    def to_json(self) -> dict[str, list[Any]]:
        return {"t_s": [round(t, 6) for t in self.t_s], "tokens": list(self.tokens),
                "first_token_s": [round(t, 6) for t in sorted(self.first_token_s)],
                "finished_s": [round(t, 6) for t in sorted(self.finished_s)]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "StepTrace":
        return StepTrace([float(t) for t in d["t_s"]], [int(n) for n in d["tokens"]],
                         [float(t) for t in d["first_token_s"]], [float(t) for t in d["finished_s"]])


class RequestClock:
    """First and last token times by request id, for a loop that sees request ids (vLLM's engine-core outputs)."""

    def __init__(self, trace: StepTrace) -> None:
        self._trace = trace
        self._seen: set[str] = set()

    def observe(self, t_s: float, request_id: str, finished: bool) -> None:
        if request_id not in self._seen:
            self._seen.add(request_id)
            self._trace.first_token_s.append(t_s)
        if finished:
            self._trace.finished_s.append(t_s)


@dataclass(frozen=True)
class BatchBin:
    lo: int            # tokens a step, inclusive
    hi: int            # exclusive
    steps: int
    median_ms: float   # a step's time: from the step before's tokens to its own
    total_s: float


@dataclass(frozen=True)
class PhaseSummary:
    steps: int
    prefill_end_s: float       # the step that brought the last first token: every prompt had started by then
    prefill_steps: int         # steps until then, that one included
    end_s: float               # the last request's last token
    tail_steps: int            # steps after the prefill phase
    tail_s: float
    tail_bins: list[BatchBin]  # the tail's steps by how many tokens each gave (its batch)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_summary(trace: StepTrace) -> PhaseSummary:
    """The prefill phase and the decode tail of one run (pure)."""
    if not trace.t_s or not trace.first_token_s or not trace.finished_s:
        raise ValueError("an empty step trace: no step gave a token")
    # The step whose call brought the last first token: the first step recorded at or after it (kvfleet stamps a
    # request's tokens inside the call, the trace when the call returns; vLLM's are stamped with the step itself).
    last = min(bisect.bisect_left(trace.t_s, max(trace.first_token_s)), len(trace.t_s) - 1)
    prefill_end = trace.t_s[last]
    end = max(trace.finished_s)
    times, tokens = trace.t_s[last:], trace.tokens[last:]
    durations = [(b - a, n) for a, b, n in zip(times, times[1:], tokens[1:], strict=False)]
    bins = []
    for lo, hi in BATCH_BINS:
        ds = [d for d, n in durations if lo <= n < hi]
        if ds:
            bins.append(BatchBin(lo, hi, len(ds), statistics.median(ds) * 1e3, sum(ds)))
    return PhaseSummary(steps=len(trace.t_s), prefill_end_s=prefill_end, prefill_steps=last + 1, end_s=end,
                        tail_steps=len(durations), tail_s=sum(d for d, _ in durations), tail_bins=bins)
