"""Async scheduling (`EngineConfig.async_scheduling`; on by default on CUDA, off on CPU): keep the device busy.

With it on, one `LLMEngine.step()` does, while step N (launched by the previous call) runs:
1. schedule step N+1 as if every running decode of step N had its token already: that token is a
   placeholder (`Request.num_placeholders`: the token count advances and blocks are allocated for
   it; its id is not known yet);
2. prepare N+1's input tensors (`ModelRunner.prepare`); a placeholder's input id is taken on the
   device from step N's sampled-id tensor (index by its row in N), so nothing waits for the host;
3. launch N+1 at once (forward and sampling), queued behind N on the device, so the device goes from N to
   N+1 without waiting for the host ("launch ahead");
4. wait for N's ids (`ModelRunner.collect`; on CUDA a non-blocking copy to pinned memory + event), update
   the scheduler with the real tokens (EOS, stop ids, max/min_tokens exact), then process N's outputs
   (detokenization, stop strings, beam picks, forks, `RequestOutput`s) while N+1 runs. The outputs
   returned are step N's.

Launching ahead is skipped, and N+1 launched after step 4's update as before, when its sampler needs N's
token values: structured outputs (a constraint's next mask needs the token it takes from N) and prompt logprobs
(read back at launch). min_tokens needs only N's token count: a sequence sampled in N has one more output token
than it holds. Penalties count N's token from the device: `ModelRunner._sampling_batch` writes each sequence's
sample of N (`InFlight.sampled_on_device`) after the output ids it holds, as the inputs take their placeholders.
KVFLEET_LAUNCH_AHEAD=0 always launches after the update (issue 16's A/B).

KVFLEET_FORWARD_AHEAD=1 (off by default until a lease measures it): such a step's forward is still queued at step
3 (`ModelRunner.forward_step`), and only its sampler waits for step 4's update (`ModelRunner.sample_step`): the
device runs N+1's forward while the host reads and takes N's tokens, so one request with a grammar no
longer leaves the device idle between the steps of the whole batch. A sequence that N's tokens end is not sampled.

Correctness cases:
- no placeholder where the token just planned surely ends the sequence (max_tokens,
  max_model_len: `scheduler.may_continue`), nor for beam search (the engine picks the tokens) or a
  parent about to fork; those sequences skip one step instead. A sequence still in prefill has
  nothing sampled in flight, so it is never a placeholder case.
- a sequence that stops at step N (stop id, EOS, or a stop string seen while processing N) was
  already planned, and usually launched, in N+1: its blocks are freed at once, N+1 computes its row
  (shapes are fixed; a later step that reuses the blocks runs after it on the device) and may sample it,
  and the scheduler's update of N+1 skips it, so its extra token never shows.
- a sequence preempted by N+1's scheduling while its token was in flight keeps that token (it was
  sampled from its full context; it is appended and checked for stops when N's ids arrive).
- prefix caching hashes a block only once all its token ids are known (never past `num_tokens`).
- an abort frees the sequence at once; the launched step's row for it is discarded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from kvfleet.engine.core.runner_output import ModelRunnerOutput
from kvfleet.engine.core.scheduler import ScheduledRequest
from kvfleet.engine.sampler import SamplerOutput, TokenLogprobs


def _flag_from_env(name: str, default: str) -> bool:
    raw = os.environ.get(name, "").strip() or default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: expected '0' or '1', got {raw!r}")
    return raw == "1"


LAUNCH_AHEAD = _flag_from_env("KVFLEET_LAUNCH_AHEAD", "1")
FORWARD_AHEAD = _flag_from_env("KVFLEET_FORWARD_AHEAD", "0")


@dataclass
class InFlight:
    """A launched step: its sampled sequences, the sampler's result (host copies in flight on CUDA)
    and the output so far (prompt logprobs are collected synchronously at launch)."""

    reqs: list[ScheduledRequest]
    res: Optional[SamplerOutput]
    out: ModelRunnerOutput
    event: Optional[torch.cuda.Event] = None
    sampled_on_device: Optional[torch.Tensor] = None   # long [len(reqs)], where the next step reads

    def row_of(self) -> dict[str, int]:
        return {s.request.request_id: i for i, s in enumerate(self.reqs)}

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def copy_to_host_async(res: SamplerOutput) -> tuple[SamplerOutput, Optional[torch.cuda.Event]]:
    """Start copying every tensor of `res` to pinned host memory without waiting; the event marks
    the copies' end. Tensors already on the host are returned as they are (no event)."""
    if res.sampled.device.type != "cuda":
        return res, None

    def to_host(t: torch.Tensor) -> torch.Tensor:
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t, non_blocking=True)
        return pinned

    lp = res.logprobs
    host = SamplerOutput(to_host(res.sampled), None if lp is None else TokenLogprobs(
        to_host(lp.logprob), to_host(lp.rank), to_host(lp.top_ids), to_host(lp.top_logprobs)))
    event = torch.cuda.Event()
    event.record()
    return host, event
