"""The device's side of the step timeline (`KVFLEET_STEP_TIMELINE` on a GPU): timed CUDA events around each
launched step.

The host-side timeline says how long each call waited for the step before's tokens; it cannot say whether the
device spent the step computing or sat idle inside it. Two events a step answer that without a sync of their own:
one queued before the step's first operation and one after its last (its copies to the host), read once the step's
tokens are collected (by then both have passed). A step's device time is the span between its two events; the
device sat idle before it for the span from the step before's last event to its first (near zero when the step was
queued in time; it holds the step's input copies, queued before its first event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StepEvents:
    begin: torch.cuda.Event   # queued before the step's first operation
    end: torch.cuda.Event     # and after its last


@dataclass(frozen=True)
class GpuStepTimes:
    busy_ms: float                 # the step's first operation's start to its last one's end
    idle_before_ms: Optional[float]   # the step before's end to this one's start (None for the first step read)

    def plus(self, later: "GpuStepTimes") -> "GpuStepTimes":
        """Two steps collected in one call (the last launched step's discarded work is collected with the one
        before it): their device times and idle times summed."""
        idles = [t for t in (self.idle_before_ms, later.idle_before_ms) if t is not None]
        return GpuStepTimes(self.busy_ms + later.busy_ms, sum(idles) if idles else None)


class GpuStepClock:
    """Events for the steps of one engine, read in launch order."""

    def __init__(self) -> None:
        self._last_end: Optional[torch.cuda.Event] = None

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self, events: StepEvents) -> GpuStepTimes:
        """The times of a step whose tokens were collected (its events have passed; `synchronize` returns at
        once), relative to the step read before it."""
        events.end.synchronize()
        idle = self._last_end.elapsed_time(events.begin) if self._last_end is not None else None
        self._last_end = events.end
        return GpuStepTimes(events.begin.elapsed_time(events.end), idle)
