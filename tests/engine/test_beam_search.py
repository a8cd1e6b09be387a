"""Beam search decisions on hand-made log-probabilities (the engine side is tested against transformers)."""

from __future__ import annotations

import math

from kvfleet.engine.core.beam_search import Beam, BeamSearchState

EOS = 0


def lp(p: float) -> float:
    return math.log(p)


def test_expands_forks_and_finishes_with_length_penalty() -> None:
    st = BeamSearchState(width=2, max_new_tokens=5, eos_token_ids=frozenset({EOS}))
    assert st.num_candidates == 4
    step = st.step([Beam("a", [], 0.0)], {"a": [(5, lp(0.5)), (6, lp(0.3)), (EOS, lp(0.1)), (7, lp(0.05))]})
    # Both new beams come from the one parent (a fork); eos is 3rd, outside the first `width`: not finished.
    assert [(p, t) for p, t, _ in step.next_beams] == [("a", 5), ("a", 6)] and not st.finished
    beams = [Beam("a", [5], lp(0.5)), Beam("b", [6], lp(0.3))]
    step = st.step(beams, {"a": [(EOS, lp(0.9)), (8, lp(0.05)), (9, lp(0.03)), (10, lp(0.02))],
                           "b": [(11, lp(0.6)), (12, lp(0.3)), (EOS, lp(0.05)), (13, lp(0.05))]})
    # a+eos is the best candidate: finished with score / 2 (generated length incl. eos).
    assert st.finished[0].tokens == [5, EOS]
    assert math.isclose(st.finished[0].score, (lp(0.5) + lp(0.9)) / 2)
    assert [(p, t) for p, t, _ in step.next_beams] == [("b", 11), ("b", 12)]   # "a" is dropped
    assert not step.done


def test_stops_when_running_beams_cannot_beat_finished_ones() -> None:
    st = BeamSearchState(width=1, max_new_tokens=10, eos_token_ids=frozenset({EOS}))
    step = st.step([Beam("a", [], 0.0)], {"a": [(EOS, lp(0.6)), (4, lp(0.4))]})
    # One finished hypothesis fills the width; the best running beam (0.4 / 1) cannot beat 0.6.
    assert step.done and st.best(1)[0].tokens == [EOS]


def test_max_length_finishes_the_top_candidates() -> None:
    st = BeamSearchState(width=2, max_new_tokens=1, eos_token_ids=frozenset({EOS}))
    step = st.step([Beam("a", [], 0.0)], {"a": [(3, lp(0.5)), (4, lp(0.3)), (5, lp(0.1)), (6, lp(0.1))]})
    assert step.done and [h.tokens for h in st.best(2)] == [[3], [4]]
