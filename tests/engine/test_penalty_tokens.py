"""The penalties' per-sequence token arrays: outputs grow by what was added, rows pad as the sampler expects."""

from __future__ import annotations

import numpy as np

from kvfleet.engine.penalty_tokens import TokenHistory, padded_rows


def test_outputs_follow_a_growing_list_past_the_first_buffer() -> None:
    history = TokenHistory([5, 6, 7])
    assert history.prompt.tolist() == [5, 6, 7] and history.prompt.dtype == np.int64
    outputs: list[int] = []
    assert history.outputs(outputs).tolist() == []
    for step in range(300):   # past the 64-token buffer, several times
        outputs += [step % 50] * (1 + step % 3)   # one to three tokens a step
        assert history.outputs(outputs).tolist() == outputs
    assert history.outputs(outputs).tolist() == outputs   # no new token: the same ids


def test_padded_rows_pad_after_each_row() -> None:
    rows = [np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([4])]
    assert padded_rows(rows, 9).tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9]]
    assert padded_rows([np.array([], dtype=np.int64)], 9).tolist() == [[9]]   # at least one column
