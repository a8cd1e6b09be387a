"""A user request and its sequences (n samples or beams), and the `RequestOutput` it shows.

Pure Python over the tokenizer: text, logprobs and finish reasons per sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvfleet.engine.core.beam_search import Beam, BeamSearchState
from kvfleet.engine.core.detokenizer import IncrementalDetokenizer
from kvfleet.engine.core.request import Request
from kvfleet.engine.core.runner_output import PromptLogprob, SampleLogprobs
from kvfleet.engine.outputs import CompletionOutput, Logprob, LogprobsDict, RequestMetrics, RequestOutput
from kvfleet.engine.sampling_params import SamplingParams


def logprobs_dict(tokenizer: Any, token_id: int, lp: float, rank: int, top_ids: list[int],
                  top_lps: list[float]) -> LogprobsDict:
    def dec(t: int) -> Optional[str]:
        return tokenizer.decode([t]) if tokenizer is not None else None

    out: LogprobsDict = {token_id: Logprob(lp, rank, dec(token_id))}
    for i, (t, v) in enumerate(zip(top_ids, top_lps, strict=True)):
        if t not in out:
            out[t] = Logprob(v, i + 1, dec(t))
    return out


@dataclass
class SeqState:
    seq: Request
    detok: IncrementalDetokenizer
    logprobs: Optional[list[LogprobsDict]] = None
    cum_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None


@dataclass
class RequestGroup:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any
    metrics: RequestMetrics
    seqs: dict[int, SeqState] = field(default_factory=dict)
    prompt_logprobs: Optional[list[Optional[LogprobsDict]]] = None
    beam: Optional[BeamSearchState] = None
    beam_live: list[Beam] = field(default_factory=list)
    beam_pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    beam_result: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    aborted: bool = False
    fork_counter: int = 0

    def __post_init__(self) -> None:
        self._num_samples = self.params.num_samples   # read every step by `finished`

    def new_detok(self) -> IncrementalDetokenizer:
        p = self.params
        return IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, tuple(p.stop or ()),
                                      p.include_stop_str_in_output)

    def add_seq(self, seq: Request) -> SeqState:
        st = SeqState(seq, self.new_detok(), [] if self.params.logprobs is not None else None)
        self.seqs[seq.index] = st
        return st

    def record_token(self, st: SeqState, token_id: int, lp: Optional[SampleLogprobs],
                     now: Optional[float] = None) -> Optional[str]:
        """A new sampled token (`now`: when its step produced it): logprobs and text; returns
        the stop string hit, if any."""
        if lp is not None:
            st.cum_logprob += lp.logprob
            if st.logprobs is not None:
                k = self.params.logprobs or 0
                st.logprobs.append(logprobs_dict(self.tokenizer, token_id, lp.logprob, lp.rank, lp.top_ids[:k],
                                                 lp.top_logprobs[:k]))
        if now is None:
            now = time.monotonic()
        metrics = self.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        return st.detok.update(st.seq.output_token_ids)

    def add_prompt_logprobs(self, entries: list[PromptLogprob]) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        k = self.params.prompt_logprobs or 0
        for e in entries:
            if e.position == len(self.prompt_logprobs):  # a recompute after preemption repeats positions
                self.prompt_logprobs.append(logprobs_dict(self.tokenizer, e.token_id, e.logprob, e.rank,
                                                          e.top_ids[:k], e.top_logprobs[:k]))

    @property
    def finished(self) -> bool:
        if self.aborted:
            return True
        if self.beam is not None:
            return bool(self.beam_result)
        seqs = self.seqs
        if len(seqs) != self._num_samples or not seqs:
            return False
        for st in seqs.values():
            if st.finish_reason is None:
                return False
        return True

    def make_output(self, done: Optional[bool] = None) -> RequestOutput:
        """The output so far; `done` is `self.finished` when the caller has it already."""
        if done is None:
            done = self.finished
        if done and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        if self.beam is not None and not self.aborted:
            outputs = self.beam_result   # beams are only shown once the search is over
        elif len(self.seqs) == 1 and not self.aborted and self._num_samples == 1:
            # One sequence (most requests): the general branch below, without its sorting and passes.
            st = next(iter(self.seqs.values()))
            seq = st.seq
            outputs = [CompletionOutput(seq.index, st.detok.visible_text(st.finish_reason is not None),
                                        list(seq.output_token_ids), st.cum_logprob, st.logprobs,
                                        st.finish_reason, st.stop_reason)]
        else:
            seqs = self.seqs
            states = list(seqs.values()) if len(seqs) == 1 else [seqs[i] for i in sorted(seqs)]
            outputs = [CompletionOutput(
                index=st.seq.index, text=st.detok.visible_text(st.finish_reason is not None),
                token_ids=list(st.seq.output_token_ids), cumulative_logprob=st.cum_logprob,
                logprobs=st.logprobs, finish_reason=st.finish_reason, stop_reason=st.stop_reason,
            ) for st in states]
            if self.aborted:
                for o in outputs:
                    o.finish_reason = o.finish_reason or "abort"
            if done and len(outputs) > self.params.n:
                # best_of > n: the n samples with the highest cumulative log-probability.
                outputs = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))[:self.params.n]
                for i, o in enumerate(outputs):
                    o.index = i
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, finished=done, prompt_logprobs=self.prompt_logprobs, metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )
