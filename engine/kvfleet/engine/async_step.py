"""Async scheduling (`EngineConfig.async_scheduling`, default off): overlap host work with the device.

With it on, `LLMEngine.step()` for step N launches the forward and sampling (`ModelRunner.launch`;
on CUDA the sampled ids go to pinned host memory with a non-blocking copy and a CUDA event, so
nothing waits), then processes the outputs of step N-1 — detokenization, stop strings, per-request
bookkeeping, `RequestOutput`s: the largest host part of a decode step in bench/NOTES.md — while the
device works, and only then waits for step N's token ids (`ModelRunner.collect`). The scheduler is
updated at once (its token-based stops — EOS, stop ids, max_tokens, min_tokens — are exact and
applied before step N+1 is scheduled); the engine's own processing of step N waits one step.

What this does not do (yet): schedule step N+1 before step N's tokens are on the host (vLLM's
placeholder tokens). Here only output processing overlaps the device.

Correctness cases:
- a stop string is only seen when a step's outputs are processed, i.e. one step late: the request
  was already scheduled again; `finish_requests` frees its blocks at once and the scheduler's update
  of that step skips it (it is no longer RUNNING), so its extra token is dropped.
- groups whose updates need the engine before the next schedule (beam search picks, forks of n>1
  samples) are processed at once, as in the synchronous engine, and so are prompt logprobs; the
  other groups of the same step still wait.
- an abort first processes the pending outputs (so the aborted output has every token), and the
  outputs that produced for other requests are returned by the next `step()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from kvfleet.engine.core.scheduler import ModelRunnerOutput, RequestUpdate, ScheduledRequest
from kvfleet.engine.sampler import SamplerOutput


@dataclass
class InFlight:
    """A launched step: its sampled sequences, the sampler's result (host copies in flight on CUDA)
    and the output so far (prompt logprobs are collected synchronously at launch)."""

    reqs: list[ScheduledRequest]
    res: Optional[SamplerOutput]
    out: ModelRunnerOutput
    event: Optional[torch.cuda.Event] = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def copy_to_host_async(res: SamplerOutput) -> tuple[SamplerOutput, Optional[torch.cuda.Event]]:
    """Start copying every tensor of `res` to pinned host memory without waiting; the event marks
    the copies' end. Tensors already on the host are returned as they are (no event)."""
    if res.sampled.device.type != "cuda":
        return res, None
    host: dict[str, Optional[torch.Tensor]] = {}
    for f in fields(res):
        t = getattr(res, f.name)
        if t is not None:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            t = pinned
        host[f.name] = t
    event = torch.cuda.Event()
    event.record()
    return SamplerOutput(**host), event   # type: ignore[arg-type]


@dataclass
class PendingOutputs:
    """A step whose scheduler update is done and whose engine-side processing waits one step."""

    updates: list[RequestUpdate]
    result: ModelRunnerOutput


def split_updates(updates: list[RequestUpdate]) -> tuple[list[RequestUpdate], list[RequestUpdate]]:
    """(now, later): the updates the engine must process before the next schedule — every update
    of a group that has a beam-search pick or a fork of n>1 samples (no sampled token) — and the
    plain sampled tokens, whose processing may wait until the next step is launched."""
    eager = {u.request.group_id for u in updates if u.new_token_id is None}
    if not eager:
        return [], updates
    now = [u for u in updates if u.request.group_id in eager]
    return now, [u for u in updates if u.request.group_id not in eager]
