"""What the model runner returns for a step: sampled tokens and logprobs as named records (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class SampleLogprobs(NamedTuple):
    """A sampled token's log-probability, its rank (1 = most likely) and the step's top-k for it
    (k = the sequence's `num_logprobs`; beam search reads its candidates from the top-k)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprob(NamedTuple):
    """Prompt logprobs of the prompt token at `position` (>= 1: predicted from the tokens before it)."""

    position: int
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """Keyed by sequence (request) id; the scheduler reads only `sampled_token_ids`."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)   # request id -> next token
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
