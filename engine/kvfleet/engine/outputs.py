"""What the engine returns: vLLM's `RequestOutput`, `CompletionOutput` and `Logprob`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One position's log-probabilities: token id -> Logprob (the sampled token plus the top k).
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None          # 1 = most likely
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[LogprobsDict]] = None
    finish_reason: Optional[str] = None        # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None       # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchSequence:
    tokens: list[int]            # prompt + generated, as vLLM's
    text: str                    # the generated text
    cum_logprob: float
    finish_reason: Optional[str] = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


@dataclass
class RequestMetrics:
    """time.monotonic() stamps, for TTFT and inter-token latency."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
