"""A per-step timeline of the engine, for diagnosis (`KVFLEET_STEP_TIMELINE=<file>`; off by default).

Each `LLMEngine.step()` call appends one JSON line: when the call began (seconds from the timeline's start, the
monotonic clock), how long it took, the shape of the step it scheduled (prompt tokens, decode rows, prompts whose
first chunk it is), whether it was launched ahead (kvfleet.engine.async_step) and how long the call waited for the
step before's tokens (little or none: the device was idle, waiting for the host), the scheduler's queue lengths
after it, the outputs it returned and the requests taken in since the call before; on a GPU also the device's time
on the step it collected and the device's idle time before that step (kvfleet.engine.gpu_step_clock). The time
between one call's end and the next call's start is the caller's (the server's step loop: taking requests in,
handing outputs over).

Issue 16's 300-at-once row waits ~7 % longer for its first step online than the same work does in process; the
online and the offline timelines of the same burst side by side (`bench/step_timeline.py`) say whether the steps
are slower online or start later. A line is written (and flushed) per step: a few µs of the step loop's time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import IO, Mapping, Optional

from kvfleet.engine.core.scheduler import SchedulerOutput
from kvfleet.engine.env_settings import EnvSettingError

ENV_VAR = "KVFLEET_STEP_TIMELINE"


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one scheduled step computes."""
    prompt_tokens: int   # tokens of rows still in their prompt (chunks included)
    decode_rows: int     # rows that compute one token after their prompt
    first_chunks: int    # prompts that start in this step (their first chunk, after any prefix-cache hit)


def shape_of(sched: SchedulerOutput) -> StepShape:
    prompt_tokens = decode_rows = first_chunks = 0
    for s in sched.scheduled:
        if s.start >= s.request.num_prompt_tokens:
            decode_rows += 1
            continue
        prompt_tokens += s.num_new_tokens
        first_chunks += int(s.start == s.request.num_cached_tokens)
    return StepShape(prompt_tokens, decode_rows, first_chunks)


@dataclass(frozen=True, slots=True)
class StepRecord:
    t: float                 # the call's start, seconds from the timeline's start
    call_ms: float           # the call's length (with async scheduling: mostly the wait for the step before)
    launched: Optional[StepShape]   # the step this call scheduled, or None (nothing to schedule)
    ahead: bool              # launched before the step before's tokens were read (async scheduling's launch ahead)
    collect_ms: float        # waiting for the step before's tokens (async scheduling; 0 when the device was done)
    waiting: int             # requests waiting after the call
    running: int
    outputs: int             # RequestOutputs the call returned
    added: int               # requests taken in since the call before (the intake between the two)
    # On a GPU (kvfleet.engine.gpu_step_clock), of the step whose tokens this call collected: the device's time on
    # it, first operation to last, and its idle time before it (None off a GPU, or for the first step read)
    gpu_ms: Optional[float] = None
    gpu_idle_ms: Optional[float] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> "StepRecord":
        d = json.loads(line)
        shape = d.get("launched")
        gpu_ms, idle_ms = d.get("gpu_ms"), d.get("gpu_idle_ms")   # absent from older timelines (leases 29-30)
        return StepRecord(float(d["t"]), float(d["call_ms"]), StepShape(**shape) if shape is not None else None,
                          bool(d["ahead"]), float(d["collect_ms"]), int(d["waiting"]), int(d["running"]),
                          int(d["outputs"]), int(d["added"]), float(gpu_ms) if gpu_ms is not None else None,
                          float(idle_ms) if idle_ms is not None else None)


class StepTimeline:
    """Appends `StepRecord`s to a file as JSON lines."""

    def __init__(self, path: str) -> None:
        self._file: Optional[IO[str]] = open(path, "w", encoding="utf-8", buffering=1)   # line-buffered
        self._origin = time.monotonic()
        self._lock = threading.Lock()   # the step loop writes; shutdown may close from another thread

    @staticmethod
    def from_env(environ: Mapping[str, str] = os.environ) -> Optional["StepTimeline"]:
        path = environ.get(ENV_VAR, "").strip()
        if not path:
            return None
        try:
            return StepTimeline(path)
        except OSError as e:   # named for the variable that asked for it, not as a failed model load
            raise EnvSettingError(f"{ENV_VAR}: cannot write {path!r}: {e.strerror or e}") from e

    def add(self, start: float, end: float, launched: Optional[StepShape], ahead: bool, collect_ms: float,
            waiting: int, running: int, outputs: int, added: int, gpu_ms: Optional[float] = None,
            gpu_idle_ms: Optional[float] = None) -> None:
        rec = StepRecord(round(start - self._origin, 6), round((end - start) * 1e3, 3), launched, ahead,
                         round(collect_ms, 3), waiting, running, outputs, added,
                         round(gpu_ms, 3) if gpu_ms is not None else None,
                         round(gpu_idle_ms, 3) if gpu_idle_ms is not None else None)
        with self._lock:
            if self._file is not None:
                self._file.write(rec.to_json() + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_timeline(path: str) -> list[StepRecord]:
    with open(path, encoding="utf-8") as f:
        return [StepRecord.from_json(line) for line in f if line.strip()]
