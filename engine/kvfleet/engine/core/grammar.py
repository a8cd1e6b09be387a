"""What the scheduler and the model runner need of a sequence's output constraint (structured outputs).

The constraint itself (llguidance, compiled from a JSON schema, a regex, ...) lives in
kvfleet.engine.structured_outputs; the core only advances it with each sampled token and ends the
sequence once it is complete, so it stays free of that library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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
