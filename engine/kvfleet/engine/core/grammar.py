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

    def needs_last_token(self) -> bool:
        """Whether the next mask depends on the tokens accepted so far. False (the same mask at every step): the
        next step may be launched before the step in flight's token is accepted (async scheduling's launch
        ahead), as for a sequence without a constraint."""
        ...


ReasoningStart = Literal["thinking", "answering", "either"]


def _full_row(bitmask: "NDArray[np.int32]", row: int) -> None:
    bitmask[row] = -1   # every bit set: any token


def thinking_token(state: ReasoningStart, token_id: int, start_token_id: int) -> bool:
    """Whether `token_id`, coming in `state`, is part of the thinking (the markers included)."""
    return state == "thinking" or (state == "either" and token_id == start_token_id)


def reasoning_after(state: ReasoningStart, token_id: int, start_token_id: int, end_token_id: int) -> ReasoningStart:
    """The state after `token_id`: the end marker ends the thinking, the start marker opens it where the output may
    open it, any other token of an undecided output is the answer's."""
    if state == "thinking":
        return "answering" if token_id == end_token_id else "thinking"
    return "thinking" if state == "either" and token_id == start_token_id else "answering"


def _bit(token_id: int) -> tuple[int, int]:
    """(word, int32 value with only token_id's bit set): bit 31 is the int32's sign bit."""
    word, bit = divmod(token_id, 32)
    return word, (1 << bit) - (1 << 32 if bit == 31 else 0)


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
        thinking = thinking_token(self.state, token_id, self.start_token_id)
        self.state = reasoning_after(self.state, token_id, self.start_token_id, self.end_token_id)
        return True if thinking else self.inner.accept(token_id)

    def is_terminated(self) -> bool:
        return self.state == "answering" and self.inner.is_terminated()

    def fork(self) -> "AfterReasoning":
        return AfterReasoning(self.inner.fork(), self.start_token_id, self.end_token_id, self.state)

    def bitmask_words(self) -> int:
        return self.inner.bitmask_words()

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        if self.state == "thinking":
            _full_row(bitmask, row)
            return
        self.inner.fill_bitmask(bitmask, row)
        if self.state == "either":
            word, value = _bit(self.start_token_id)
            bitmask[row, word] |= value

    def needs_last_token(self) -> bool:
        return True   # </think> switches the mask


class TokenSet:
    """vLLM's `allowed_token_ids`: only these tokens, at every step (a fixed row, packed once)."""

    def __init__(self, words: "NDArray[np.int32]") -> None:
        self.words = words   # int32 [W]: the packed set

    def accept(self, token_id: int) -> bool:
        word, bit = divmod(token_id, 32)
        return word < len(self.words) and bool((int(self.words[word]) >> bit) & 1)

    def is_terminated(self) -> bool:
        return False

    def fork(self) -> "TokenSet":
        return self   # no state

    def bitmask_words(self) -> int:
        return len(self.words)

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        _full_row(bitmask, row)
        bitmask[row, :len(self.words)] = self.words

    def needs_last_token(self) -> bool:
        return False


class BannedSequences:
    """vLLM's `bad_words` as token sequences: a sequence's last token is banned where the output so far ends with
    the rest of it (a one-token sequence: always)."""

    def __init__(self, sequences: "list[tuple[int, ...]]", words: int) -> None:
        self.sequences = sequences
        self.words = words
        self.tail: tuple[int, ...] = ()   # the output's last tokens, as many as the longest prefix needs
        self.keep = max((len(s) - 1 for s in sequences), default=0)

    def accept(self, token_id: int) -> bool:
        allowed = token_id not in self._banned()
        if self.keep:
            self.tail = (self.tail + (token_id,))[-self.keep:]
        return allowed

    def _banned(self) -> set[int]:
        return {s[-1] for s in self.sequences
                if len(s) == 1 or (len(self.tail) >= len(s) - 1 and self.tail[len(self.tail) - len(s) + 1:] == s[:-1])}

    def is_terminated(self) -> bool:
        return False

    def fork(self) -> "BannedSequences":
        twin = BannedSequences(self.sequences, self.words)
        twin.tail = self.tail
        return twin

    def bitmask_words(self) -> int:
        return self.words

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        _full_row(bitmask, row)
        for token in self._banned():
            word, value = _bit(token)
            bitmask[row, word] &= ~value

    def needs_last_token(self) -> bool:
        return self.keep > 0   # one-token sequences only: the same tokens banned at every step


class AllOf:
    """Several constraints on one sequence: a token must be allowed by each; the output is complete when one
    constraint's is (only structured outputs end one)."""

    def __init__(self, parts: "list[TokenGrammar]") -> None:
        self.parts = parts

    def accept(self, token_id: int) -> bool:
        return all([p.accept(token_id) for p in self.parts])   # a list: every part advances

    def is_terminated(self) -> bool:
        return any(p.is_terminated() for p in self.parts)

    def fork(self) -> "AllOf":
        return AllOf([p.fork() for p in self.parts])

    def bitmask_words(self) -> int:
        return max(p.bitmask_words() for p in self.parts)

    def fill_bitmask(self, bitmask: "NDArray[np.int32]", row: int) -> None:
        import numpy as np

        first, *rest = self.parts
        first.fill_bitmask(bitmask, row)
        scratch = np.empty((1, bitmask.shape[1]), dtype=np.int32)
        for part in rest:
            scratch[0] = -1
            part.fill_bitmask(scratch, 0)
            bitmask[row] &= scratch[0]

    def needs_last_token(self) -> bool:
        return any(p.needs_last_token() for p in self.parts)
