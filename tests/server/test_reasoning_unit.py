"""Reasoning outputs, the pure parts: where an output's thinking starts and ends, what a stream may send of it
while it grows, and the structured-output constraint held for the answer after it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvfleet.engine.core.grammar import AfterReasoning
from kvfleet.engine.server.args import SERVE_FLAGS
from kvfleet.engine.server.chat import Sent, stream_delta
from kvfleet.engine.server.protocol import RESERVED_TEMPLATE_KWARGS
from kvfleet.engine.server.reasoning import (
    REASONING_FORMATS,
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningReader,
    ReasoningSplit,
    reasoning_parser,
    split_reasoning,
)
from kvfleet.engine.server.tools import ToolMode

R1, QWEN3, MISTRAL = REASONING_FORMATS["deepseek_r1"], REASONING_FORMATS["qwen3"], REASONING_FORMATS["mistral"]
START, END = 7, 9   # the markers' token ids below


def test_the_prompts_last_marker_says_where_the_output_starts() -> None:
    qwen3, r1 = ReasoningParser("qwen3", QWEN3, START, END), ReasoningParser("deepseek_r1", R1, START, END)
    assert qwen3.start([1, 2, START]) == r1.start([1, START, 3]) == "thinking"   # the template opened it
    assert qwen3.start([START, 5, END, 4]) == r1.start([END]) == "answering"      # closed (thinking off)
    assert qwen3.start([1, 2]) == "either" and r1.start([1, 2]) == "thinking"    # no marker: the format's rule


def test_outputs_split_into_thinking_and_answer() -> None:
    assert split_reasoning("a plan</think>\n\nThe answer", R1, "thinking", True) == \
        ReasoningSplit("a plan", "\n\nThe answer")
    assert split_reasoning("<think>a plan</think>ok", QWEN3, "either", True) == ReasoningSplit("a plan", "ok")
    assert split_reasoning("just an answer", QWEN3, "either", True) == ReasoningSplit(None, "just an answer")
    assert split_reasoning("no </think> here", QWEN3, "answering", True) == ReasoningSplit(None, "no </think> here")
    assert split_reasoning("cut off while thin", R1, "thinking", True) == ReasoningSplit("cut off while thin", None)
    assert split_reasoning("<think>x</think>", QWEN3, "thinking", True) == ReasoningSplit("x", "")
    # Magistral's markers (special tokens, decoded kept): thinking only if the output opens it
    assert MISTRAL.special_markers and not QWEN3.special_markers and not R1.special_markers
    assert split_reasoning("[THINK]a plan[/THINK]ok", MISTRAL, "either", True) == ReasoningSplit("a plan", "ok")
    assert split_reasoning("just an answer", MISTRAL, "either", True) == ReasoningSplit(None, "just an answer")
    assert split_reasoning("[THI", MISTRAL, "either", False) == ReasoningSplit(None, None)   # a marker cut off


@pytest.mark.parametrize("text,fmt,start", [
    ("<think>step one, step two</think>\n\nThe answer is 4.", QWEN3, "either"),
    ("plan: add</think>4", R1, "thinking"),
    ("<thin is no marker", QWEN3, "either"),
    ("no thinking at all", QWEN3, "either"),
    ("thinking to the end", R1, "thinking"),
    ("[THINK]plan[/THINK]The answer.", MISTRAL, "either"),
    ("still thinking[/THINK]done", MISTRAL, "thinking"),
])
def test_a_stream_sends_every_character_once_and_in_its_place(text: str, fmt: Any, start: Any) -> None:
    """The output grows one character at a time (markers cut anywhere): what the stream sends as reasoning and
    as content, joined, is the non-streamed answer's, and no marker (or part of one) is ever sent."""
    reader = ReasoningReader(fmt, start)
    none = ToolMode("none")
    sent, reasoning, content = Sent(), "", ""
    for i in range(1, len(text) + 1):
        step = stream_delta(none, reader, text[:i], sent, "stop" if i == len(text) else None, True)
        if step is None:
            continue
        body, _, sent = step
        reasoning += body.get("reasoning", "")
        content += body.get("content", "")
    whole = reader.split(text, final=True)
    assert (reasoning, content) == (whole.reasoning or "", whole.content or "")
    assert "</think>" not in reasoning


def test_the_parser_needs_its_markers_as_single_tokens() -> None:
    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    parser = reasoning_parser("qwen3", Tok({"<think>": 3, "</think>": 4, "a": 0}))
    assert (parser.start_token_id, parser.end_token_id) == (3, 4)
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: the model's tokenizer has no </think>"):
        reasoning_parser("deepseek_r1", Tok({"<think>": 3}))


class OnlyTokens:
    """A constraint that allows a fixed set of tokens, then ends after `length` of them (the wrapper's unit test;
    the real constraint, llguidance's, is tested through the server)."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed, self.left = allowed, length

    def accept(self, token_id: int) -> bool:
        self.left -= 1
        return token_id in self.allowed

    def is_terminated(self) -> bool:
        return self.left <= 0

    def fork(self) -> "OnlyTokens":
        return OnlyTokens(set(self.allowed), self.left)

    def bitmask_words(self) -> int:
        return 2

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= np.array(1 << (t % 32), dtype=np.uint32).view(np.int32)

    def needs_last_token(self) -> bool:
        return True


def allowed(grammar: Any) -> list[int]:
    mask = np.zeros((1, 2), dtype=np.int32)
    grammar.fill_bitmask(mask, 0)
    return [int(t) for t in np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))]


def test_the_constraint_holds_for_the_answer_after_the_thinking() -> None:
    thinking = AfterReasoning(OnlyTokens({1, 2}, 2), START, END, "thinking")
    assert allowed(thinking) == list(range(64))           # any token while thinking
    assert thinking.accept(40) and thinking.accept(END)   # ... until its end marker
    copy = thinking.fork()
    assert allowed(thinking) == [1, 2] and thinking.accept(1) and not thinking.is_terminated()
    assert thinking.accept(2) and thinking.is_terminated()
    assert allowed(copy) == [1, 2] and not copy.is_terminated()   # a fork goes on by itself
    either = AfterReasoning(OnlyTokens({1, 2, 63}, 1), 31, END, "either")
    assert allowed(either) == [1, 2, 31, 63]              # the start marker (bit 31: the sign bit) or the answer
    assert either.fork().accept(31) and either.accept(1) and either.is_terminated()
    answering = AfterReasoning(OnlyTokens({1}, 1), START, END, "answering")
    assert allowed(answering) == [1] and not answering.accept(START)   # no thinking to open


def test_the_servers_parser_choices_are_the_formats_read() -> None:
    (flag,) = [f for f in SERVE_FLAGS if f.name == "--reasoning-parser"]
    assert flag.choices == REASONING_PARSERS


def test_a_request_cannot_set_what_the_template_call_itself_takes() -> None:
    """chat_template_kwargs go to transformers' apply_chat_template as **kwargs: none may name one of its own
    parameters (a request could otherwise make it tokenize, or swap the template)."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert own <= RESERVED_TEMPLATE_KWARGS
