"""What the scheduler and the model runner need of a sequence's output constraint (structured outputs).

The constraint itself (llguidance, compiled from a JSON schema, a regex, ...) lives in
kvfleet.engine.structured_outputs; the core only advances it with each sampled token and ends the
sequence once it is complete, so it stays free of that library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


class TokenGrammar(Protocol):
    """One sequence's constraint state: which tokens may come next, advanced token by token."""

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the constraint does not allow it (the state is then broken)."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: nothing more may follow (the end-of-sequence token was accepted)."""
        ...

    def fork(self) -> "TokenGrammar":
        """An independent copy in the same state (a request's `n` samples each advance their own)."""
        ...

    def bitmask_words(self) -> int:
        """The width of a bitmask row: the constraint's token table (at least the model's vocabulary) / 32."""
        ...

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (`bitmask_words()` wide): bit `t % 32` of word
        `t // 32` set = token t allowed."""
        ...


ReasoningStart = Literal["thinking", "answering", "either"]


class AfterReasoning:
    """A constraint that holds only for the answer after a reasoning model's thinking (vLLM's rule with a reasoning
    parser): any token while the model thinks, the constraint from the token after its end marker on.

    It starts as the prompt leaves the model: `thinking` (the template opened the thinking), `answering` (the
    template closed it, or the model does not think) or `either` (the model may open it with its first token: the
    start marker is allowed beside what the constraint allows, and any other first token is the answer's).
    """

    def __init__(self, inner: TokenGrammar, start_token_id: int, end_token_id: int,
                 state: ReasoningStart) -> None:
        self.inner = inner
        self.start_token_id = start_token_id
        self.end_token_id = end_token_id
        self.state: ReasoningStart = state

    def accept(self, token_id: int) -> bool:
        if self.state == "thinking":
            if token_id == self.end_token_id:
                self.state = "answering"
            return True
        if self.state == "either" and token_id == self.start_token_id:
            self.state = "thinking"
            return True
        self.state = "answering"
        return self.inner.accept(token_id)

    def is_terminated(self) -> bool:
        return self.state == "answering" and self.inner.is_terminated()

    def fork(self) -> "AfterReasoning":
        return AfterReasoning(self.inner.fork(), self.start_token_id, self.end_token_id, self.state)

    def bitmask_words(self) -> int:
        return self.inner.bitmask_words()

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        if self.state == "thinking":
            bitmask[row] = -1   # every bit set: any token
            return
        self.inner.fill_bitmask(bitmask, row)
        if self.state == "either":
            word, bit = divmod(self.start_token_id, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)   # bit 31 is int32's sign bit
