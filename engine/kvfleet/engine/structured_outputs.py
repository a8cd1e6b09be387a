"""Structured outputs: a request's `StructuredOutputsParams` compiled into a per-sequence constraint (I/O edge to
llguidance, the library behind vLLM's `guidance` backend).

`GrammarCompiler.compile` turns the JSON schema, JSON object, regex, choice or Lark grammar into a `GuidedGrammar`
(kvfleet.engine.core.grammar.TokenGrammar) or raises a ValueError naming the field; the model runner asks each
constrained sequence for its bitmask of allowed tokens every step and the sampler masks the rest; the scheduler
advances it with each sampled token and ends the sequence once the output is complete.

The engine imports this module, and llguidance with it, on the first constrained request; the tokenizer's token
table for llguidance is built then too (about a second for a large vocabulary), not at start: most replicas never
see one.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Iterable, Optional

import llguidance.hf
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask
from numpy.typing import NDArray

from kvfleet.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
FIELD = "structured_outputs"


def grammar_source(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for a validated spec (pure); a ValueError names the field."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)   # validated as JSON text already
        try:
            return LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not spec.disable_any_whitespace})
        except ValueError as exc:
            raise ValueError(f"{FIELD}.{kind}: {exc}") from None
    if kind == "regex":
        assert spec.regex is not None
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        # One literal per choice; JSON string escapes are Lark's.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    return LLMatcher.grammar_from_lark(spec.grammar)


def one_line(error: str, limit: int = 500) -> str:
    """llguidance's error without its source excerpts and carets (an API error is one line): the first line and
    any `error:` lines."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    text = " ".join(kept)
    return text if len(text) <= limit else text[:limit] + "..."


class GuidedGrammar:
    """A sequence's constraint: an llguidance matcher (kvfleet.engine.core.grammar.TokenGrammar)."""

    def __init__(self, matcher: LLMatcher, words: int) -> None:
        self.matcher = matcher
        self.words = words

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def fork(self) -> "GuidedGrammar":
        return GuidedGrammar(self.matcher.deep_copy(), self.words)

    def bitmask_words(self) -> int:
        return self.words

    def fill_bitmask(self, bitmask: NDArray[np.int32], row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def needs_last_token(self) -> bool:
        return True


class GrammarCompiler:
    """Compiles requests' constraints against one model's tokenizer (thread-safe: the server compiles on its
    threads, the engine's step loop runs the matchers)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll: Optional[LLTokenizer] = None

    def token_table(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built on first use."""
        with self._lock:
            if self._ll is None:
                self._ll = self._build_token_table()
            return self._ll

    def _build_token_table(self) -> LLTokenizer:
        if self.hf_tokenizer is None:
            raise ValueError(f"{FIELD}: this model has no tokenizer, so its output cannot be constrained")
        width = max(self.vocab_size, len(self.hf_tokenizer))
        try:
            table = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=width,
                                                 eos_token=self.eos_token_ids or None)
        except ValueError as exc:   # a slow (Python) tokenizer
            raise ValueError(f"{FIELD}: this model's tokenizer cannot be used for structured outputs: "
                             f"{exc}") from None
        logger.info("structured outputs: token table built", extra={"vocab": width})
        return table

    def compile(self, spec: StructuredOutputsParams) -> GuidedGrammar:
        """The constraint's initial state; a ValueError names the field (an invalid schema, regex or grammar)."""
        table = self.token_table()
        matcher = LLMatcher(table, grammar_source(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{FIELD}.{spec.kind}: {one_line(matcher.get_error())}")
        return GuidedGrammar(matcher, -(-table.vocab_size // 32))
