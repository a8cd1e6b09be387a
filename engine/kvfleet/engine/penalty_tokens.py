"""Each sequence's token ids for the sampler's penalties, kept as numpy arrays from step to step.

A repetition, frequency or presence penalty needs, every step, the prompt and output token ids of each penalized
sequence on the device. Built from the requests' Python lists, padded and passed to `torch.tensor`, that cost
~40 ms of host time a decode step at ~190 sequences of chat-mix on an H100 (issue 16, lease 22: a run with
repetition_penalty 1.1 made 0.45x the tokens of one without). Here a prompt is converted once, an output grows
by the tokens added since the step before, and a step's padded array is filled one row at a time.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """One sequence's prompt and output token ids (outputs only ever grow: `Request.append_output_token`)."""

    __slots__ = ("prompt", "_out", "_n_out")

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self.prompt = np.asarray(prompt_token_ids, dtype=np.int64)
        self._out = np.empty(64, dtype=np.int64)
        self._n_out = 0

    def outputs(self, output_token_ids: list[int]) -> np.ndarray:
        """The output ids so far as an array: copies only the ones added since the last call."""
        n = len(output_token_ids)
        if n > len(self._out):
            grown = np.empty(max(n, 2 * len(self._out)), dtype=np.int64)
            grown[:self._n_out] = self._out[:self._n_out]
            self._out = grown
        if n > self._n_out:
            self._out[self._n_out:n] = output_token_ids[self._n_out:]
        self._n_out = n
        return self._out[:n]


def padded_rows(rows: list[np.ndarray], pad: int, spare: int = 0) -> np.ndarray:
    """int64 [len(rows), longest row + `spare` (at least 1)], each row's ids first, then `pad`."""
    width = max(1, max((len(r) for r in rows), default=0) + spare)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
