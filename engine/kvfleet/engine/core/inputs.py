"""Checks of a request before it reaches the scheduler (pure: numbers in, ValueError out)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

PromptType = Union[str, list[int], dict[str, Any]]


def split_prompt(prompt: PromptType) -> tuple[Optional[str], Optional[list[int]]]:
    """(text, token ids): exactly one of them is set."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _as_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' (list of ints) or 'prompt' (str)")
    if isinstance(prompt, (list, tuple)):
        return None, _as_ids(prompt)
    raise ValueError(f"prompt: must be a string, a list of token ids or a dict, got {type(prompt).__name__}")


def check_text(text: str, field: str) -> None:
    """ValueError naming `field` when `text` holds a lone UTF-16 surrogate (no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: invalid Unicode text at character {e.start} "
                         f"({text[e.start]!r} is a lone UTF-16 surrogate)") from None


def find_bad_text(value: Any, where: str) -> Optional[str]:
    """Where (e.g. "messages[0].content") a string inside `value` holds a lone surrogate; None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_bad_text(key, where) or find_bad_text(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_bad_text(item, f"{where}[{i}]")
            if found:
                return found
    return None


_INT_ONLY = frozenset({int})


def _as_ids(ids: Any) -> list[int]:
    # The common case (a JSON list of ints) at C speed: a request's ids are checked on the event loop and again
    # on the step loop, a Python-level pass over 1k ids is ~80 µs each time (issue 16, the burst's intake).
    if type(ids) is list and _INT_ONLY.issuperset(map(type, ids)):
        return list(ids)
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids: must be a list of ints")
    return list(ids)


def token_outside_vocab(token_ids: Sequence[int], vocab_size: int) -> Optional[int]:
    """The first id outside [0, vocab_size), or None. `min`/`max` scan at C speed; the offender is looked for only
    when there is one (a Python-level pass over 1k ids is ~80 µs, on every request: issue 16, the burst's intake)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        return next(t for t in token_ids if not 0 <= t < vocab_size)
    return None


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, max_tokens: Optional[int],
                 kv_capacity_tokens: int, num_sequences: int = 1, block_size: int = 1) -> int:
    """Validate a tokenized prompt; returns the resolved max_tokens (room left when not given)."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("prompt: must not be empty (0 tokens)")
    bad = token_outside_vocab(token_ids, vocab_size)
    if bad is not None:
        raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if n > max_model_len:
        raise ValueError(f"prompt: {n} tokens exceed max_model_len={max_model_len}")
    if n >= kv_capacity_tokens:   # not even one generated token fits: max_tokens is not to blame
        raise ValueError(f"prompt: {n} tokens leave no room to generate in the KV cache ({kv_capacity_tokens} "
                         f"tokens); raise num_kv_blocks or shorten the prompt")
    if max_tokens is None:
        max_tokens = max_model_len - n
        if max_tokens < 1:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len={max_model_len}")
    elif n + max_tokens > max_model_len:
        raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                         f"exceeds max_model_len={max_model_len}")
    if n + max_tokens > kv_capacity_tokens:
        raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) can never fit the KV cache "
                         f"({kv_capacity_tokens} tokens); raise num_kv_blocks or lower max_tokens")
    # Beams advance in lockstep, so all of them must fit at once (block granularity).
    per_seq = -(-(n + max_tokens) // block_size) * block_size
    if num_sequences > 1 and num_sequences * per_seq > kv_capacity_tokens:
        raise ValueError(f"best_of: {num_sequences} beams of up to {n + max_tokens} tokens can never fit the KV "
                         f"cache ({kv_capacity_tokens} tokens) together")
    return max_tokens
