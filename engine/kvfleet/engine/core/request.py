"""One schedulable sequence: its tokens, progress and stop rules.

A user request with `n > 1`, `best_of` or beam search becomes several `Request`s
(forked from one parent so they share the prompt's KV blocks); the engine groups
them back by `group_id` (a lone sequence is its own group).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvfleet.engine.core.grammar import TokenGrammar

_SEQ_COUNTER = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> Optional[str]:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()   # eos (unless ignore_eos) + user stop ids
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: Optional[str] = None
    group_id: str = ""               # the user request this sequence belongs to ("": its own id)
    index: int = 0                   # its sample / beam index inside the group
    # Stop computing once this many tokens are computed (a parent about to be forked
    # computes all but the last prompt token; its children compute that one).
    compute_limit: Optional[int] = None
    # Beam search: the engine picks tokens from the logprobs; the scheduler never appends.
    external_tokens: bool = False
    # For the model runner (opaque to the core): how to sample this sequence.
    sampling_params: Any = None
    seed: Optional[int] = None       # per-sequence seed (a group's seed + sample index)
    num_logprobs: int = -1           # top-k logprobs per sampled token (0: only its own; -1: none)
    # Structured outputs: the sequence's constraint, advanced by every token appended (None: unconstrained).
    grammar: Optional[TokenGrammar] = None
    # Async scheduling: tokens sampled by launched steps whose ids are not appended yet. The next
    # step may already compute them (their ids come from the device; kvfleet.engine.async_step).
    num_placeholders: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[object] = None
    num_cached_tokens: int = -1      # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    seq_no: int = field(default_factory=lambda: next(_SEQ_COUNTER))

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        if not self.group_id:
            self.group_id = self.request_id
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        for tok in self.output_token_ids:
            self._all_token_ids.append(tok)

    # --- tokens --------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    # --- progress ------------------------------------------------------------------
    @property
    def compute_target(self) -> int:
        """How many tokens should be computed before the next sample (or the fork)."""
        if self.compute_limit is not None:
            return min(self.compute_limit, self.num_tokens)
        return len(self._all_token_ids) + self.num_placeholders

    @property
    def num_tokens_to_compute(self) -> int:
        return self.compute_target - self.num_computed_tokens

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED   # identity checks against a constant tuple (hot path)

    def sort_key(self) -> tuple[int, float, int]:
        """Lower first: priority, then arrival (FCFS), then creation order."""
        return (self.priority, self.arrival_time, self.seq_no)

    def fork(self, request_id: str, index: int) -> "Request":
        """A copy sharing this sequence's tokens and progress (the KV manager shares blocks)."""
        child = Request(
            request_id=request_id, prompt_token_ids=list(self.prompt_token_ids),
            max_tokens=self.max_tokens, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, priority=self.priority,
            arrival_time=self.arrival_time, cache_salt=self.cache_salt, group_id=self.group_id,
            index=index, compute_limit=self.compute_limit, external_tokens=self.external_tokens,
            output_token_ids=list(self.output_token_ids),
            sampling_params=self.sampling_params, seed=self.seed, num_logprobs=self.num_logprobs,
            grammar=None if self.grammar is None else self.grammar.fork(),
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        return child
