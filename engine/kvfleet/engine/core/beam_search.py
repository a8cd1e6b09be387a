"""Beam search decisions, mirroring transformers' (v5) `_beam_search` step by step.

Pure Python: each step takes every running beam's top log-probabilities and returns
the next running beams (parent, token, score) and the finished hypotheses. The
engine turns that into forks and frees of sequences (which share KV blocks).

transformers' rules kept here: keep `max(2, 1 + n_eos) * width` candidates; only
the first `width` of them may finish (score / generated_len ** length_penalty);
candidates that hit a stop (eos or max length) never continue; the search ends
when no running beam can beat the worst of `width` finished ones
(early_stopping=False heuristic), when all are finished (early_stopping=True),
or when every candidate hits a stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, Union

_BLOCKED = -1.0e9


@dataclass
class Beam:
    key: str                  # the engine's sequence id
    tokens: list[int]         # generated tokens
    score: float              # sum of log-probabilities


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float              # length-normalised
    cum_logprob: float


class NextBeam(NamedTuple):
    parent_key: str           # the running beam it extends
    token: int
    score: float              # its new cumulative log-probability


@dataclass
class BeamStep:
    next_beams: list[NextBeam]
    done: bool


@dataclass
class BeamSearchState:
    width: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    finished: list[Hypothesis] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    num_generated: int = 0

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def step(self, beams: list[Beam], top: dict[str, list[tuple[int, float]]]) -> BeamStep:
        """`top[key]`: that beam's best (token, logprob) pairs, at least `num_candidates` of them."""
        cands = []
        for order, beam in enumerate(beams):
            for tok, lp in top[beam.key]:
                cands.append((beam.score + lp, order, tok, beam))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[:self.num_candidates]
        gen_len = self.num_generated + 1
        hits = [tok in self.eos_token_ids or gen_len >= self.max_new_tokens for _, _, tok, _ in cands]

        # Finished hypotheses (only candidates among the first `width` may finish).
        full = len(self.finished) >= self.width and self.early_stopping is True
        if self.heuristic_unsatisfied and not full:
            for i, (score, _, tok, beam) in enumerate(cands[:self.width]):
                if hits[i]:
                    self.finished.append(Hypothesis(beam.tokens + [tok], score / (gen_len ** self.length_penalty),
                                                    score))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]

        running = sorted(((score + (_BLOCKED if hit else 0.0), i) for i, ((score, _, _, _), hit)
                          in enumerate(zip(cands, hits, strict=True))), key=lambda x: (-x[0], x[1]))[:self.width]
        next_beams = [NextBeam(cands[i][3].key, cands[i][2], cands[i][0]) for s, i in running if s > _BLOCKED / 2]
        self.num_generated = gen_len

        if self.heuristic_unsatisfied and next_beams:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_len = self.max_new_tokens
            else:
                best_len = gen_len
            best_possible = next_beams[0].score / (best_len ** self.length_penalty)
            worst = min(h.score for h in self.finished) if len(self.finished) >= self.width else _BLOCKED
            self.heuristic_unsatisfied = best_possible > worst
        all_done = len(self.finished) >= self.width and self.early_stopping is True
        done = not self.heuristic_unsatisfied or all_done or all(hits) or not next_beams
        return BeamStep(next_beams=[] if done else next_beams, done=done)

    def best(self, n: int, running: Sequence[Beam] = ()) -> list[Hypothesis]:
        """The n best finished hypotheses (running beams stand in if none finished)."""
        if self.finished:
            return self.finished[:n]
        lp = self.length_penalty
        return [Hypothesis(b.tokens, b.score / (max(1, len(b.tokens)) ** lp), b.score) for b in running[:n]]
