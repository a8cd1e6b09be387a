"""Reasoning outputs for chat completions (pure): a thinking model's reasoning apart from its answer, as vLLM's
`--reasoning-parser` serves it.

A reasoning model writes its thinking between two markers, `<think>` and `</think>`, then its answer. With a
parser the server answers the thinking in the message's `reasoning` field and the rest in `content` (streams:
`delta.reasoning`, then `delta.content`); tool calls are read from the answer only, and a structured output
constrains the answer only (core.grammar.AfterReasoning).

Where the thinking starts depends on the chat template, so it is read from the prompt's last marker:
- the prompt opened it (DeepSeek-R1's templates end with `<think>`): the output starts thinking;
- the prompt closed it (Qwen3's template with `chat_template_kwargs: {"enable_thinking": false}` ends with an empty
  `<think></think>`): the output is all answer;
- no marker: `deepseek_r1` takes the output as thinking until `</think>`; `qwen3` as thinking only if it starts
  with `<think>` (Qwen3's original templates leave the model to open it).

`mistral` (Magistral) writes `[THINK]` and `[/THINK]`, special tokens of its tokenizer: its outputs are decoded with
special tokens kept (as the `mistral` tool-call parser's), and an output is thinking only if it opens with
`[THINK]` (the model opens it when its system prompt asks it to think) or the prompt left it open.

Thinking cut off before its end marker (max_tokens) is all reasoning, with no content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvfleet.engine.core.grammar import AfterReasoning, ReasoningStart, TokenGrammar, reasoning_after, thinking_token

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A `--reasoning-parser`: its markers, and how an output starts when the prompt has neither."""

    start: str
    end: str
    unmarked_prompt: ReasoningStart
    special_markers: bool = False   # the markers are special tokens: outputs are decoded with special tokens kept


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat(THINK_START, THINK_END, "thinking"),
    "qwen3": ReasoningFormat(THINK_START, THINK_END, "either"),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", "either", special_markers=True),
}
REASONING_PARSERS = tuple(REASONING_FORMATS)


@dataclass(frozen=True)
class ReasoningParser:
    """A format bound to a tokenizer: its markers are single tokens there."""

    name: str
    fmt: ReasoningFormat
    start_token_id: int
    end_token_id: int

    def start(self, prompt_ids: Sequence[int]) -> ReasoningStart:
        """How the output of this prompt starts: the prompt's last marker decides, else the format."""
        for token in reversed(prompt_ids):
            if token == self.start_token_id:
                return "thinking"
            if token == self.end_token_id:
                return "answering"
        return self.fmt.unmarked_prompt

    def reader(self, prompt_ids: Sequence[int]) -> "ReasoningReader":
        """How to read the output of this prompt."""
        return ReasoningReader(self.fmt, self.start(prompt_ids))

    def thinking_tokens(self, token_ids: Sequence[int], start: ReasoningStart) -> int:
        """How many of an output's tokens are its thinking (the markers included), read as the gate reads them."""
        state, count = start, 0
        for token in token_ids:
            if not thinking_token(state, token, self.start_token_id):
                break
            count += 1
            state = reasoning_after(state, token, self.start_token_id, self.end_token_id)
        return count

    def gate(self, grammar: TokenGrammar, start: ReasoningStart) -> AfterReasoning:
        """The request's constraint, held for the answer after the thinking."""
        return AfterReasoning(grammar, self.start_token_id, self.end_token_id, start)


def reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser `name` for this tokenizer; a ValueError if its markers are not single tokens in it."""
    fmt = REASONING_FORMATS[name]
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    ids = [vocab.get(marker) for marker in (fmt.start, fmt.end)]
    missing = [marker for marker, token in zip((fmt.start, fmt.end), ids, strict=True) if token is None]
    if missing:
        raise ValueError(f"--reasoning-parser {name}: the model's tokenizer has no {' or '.join(missing)} token")
    start_id, end_id = ids
    assert start_id is not None and end_id is not None
    return ReasoningParser(name, fmt, start_id, end_id)


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None   # the thinking (None: the output has none)
    content: str | None     # the answer after it (None: not reached)


def _without_marker_prefix(text: str, marker: str) -> str:
    """`text` less a tail that may be the start of `marker` cut between two chunks."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return text[:-keep]
    return text


def split_reasoning(text: str, fmt: ReasoningFormat, start: ReasoningStart, final: bool) -> ReasoningSplit:
    """The output so far as reasoning and answer. While it grows (`final` false) only what is surely one or the
    other is given: a tail that may become a marker is held back."""
    if start == "either":
        if text.startswith(fmt.start):
            start = "thinking"
        elif not final and fmt.start.startswith(text):
            return ReasoningSplit(None, None)   # empty, or the start marker cut between chunks
        else:
            start = "answering"
    if start == "answering":
        return ReasoningSplit(None, text)
    if not final and text and fmt.start.startswith(text) and text != fmt.start:
        return ReasoningSplit("", None)   # the start marker cut between chunks
    body = text[len(fmt.start):] if text.startswith(fmt.start) else text
    thinking, ended, answer = body.partition(fmt.end)
    if ended:
        return ReasoningSplit(thinking, answer)
    return ReasoningSplit(body if final else _without_marker_prefix(body, fmt.end), None)


@dataclass(frozen=True)
class ReasoningReader:
    """One request's output, read with its parser from where its prompt leaves the model."""

    fmt: ReasoningFormat
    start: ReasoningStart

    def split(self, text: str, final: bool) -> ReasoningSplit:
        return split_reasoning(text, self.fmt, self.start, final)
