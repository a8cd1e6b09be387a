"""Incremental detokenization and stop strings (pure Python over a HF tokenizer).

Text grows only at its end (a streaming client may rely on it): a token that
decodes to an incomplete UTF-8 character waits for the next one, and while stop
strings are pending, the last `max(len(stop)) - 1` characters are held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    _checked: int = 0          # text before this index has been searched for stop strings

    def __post_init__(self) -> None:
        # The Rust tokenizer directly when the HF wrapper would add nothing (no space clean-up):
        # the wrapper's per-call overhead is most of the cost of decoding one token.
        backend = getattr(self.tokenizer, "_tokenizer", None)
        plain = not getattr(self.tokenizer, "clean_up_tokenization_spaces", False)
        self._fast = backend.decode if backend is not None and plain and hasattr(backend, "decode") else None

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, output_ids: list[int]) -> Optional[str]:
        """Add the text of new tokens; returns the stop string hit, if any (text is then cut)."""
        if self.tokenizer is None:
            return None
        prefix = self._decode(output_ids[self.prefix_offset:self.read_offset])
        full = self._decode(output_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        return self._check_stop()

    def _check_stop(self) -> Optional[str]:
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, self._checked - longest + 1)
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self._checked = len(self.text)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: a pending stop string's prefix is held back."""
        if finished or not self.stop or self.include_stop_str_in_output:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[:len(self.text) - hold] if hold else self.text
