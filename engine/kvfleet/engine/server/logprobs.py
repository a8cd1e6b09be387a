"""Engine logprobs (`list[dict[token_id, Logprob]]`) -> the OpenAI response shapes. Pure."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

Decode = Callable[[int], str]


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp to a very small one.
    return value if math.isfinite(value) else -9999.0


def _token_text(token_id: int, entry: Any, decode: Decode) -> str:
    text = getattr(entry, "decoded_token", None)
    return text if text is not None else decode(token_id)


def _top(position: Mapping[int, Any], k: int, decode: Decode) -> list[tuple[str, float]]:
    ranked = sorted(position.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 10**9, -kv[1].logprob))
    return [(_token_text(tid, lp, decode), _finite(lp.logprob)) for tid, lp in ranked[:k]]


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None] | None,
                        top_n: int, decode: Decode, text_offset: int = 0) -> dict[str, list[Any]]:
    """The legacy completions `logprobs` object for `token_ids` (positions without data give null)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        entry = position.get(tid) if position else None
        token = _token_text(tid, entry, decode) if entry is not None else decode(tid)
        out["tokens"].append(token)
        out["token_logprobs"].append(_finite(entry.logprob) if entry is not None else None)
        if position and top_n > 0:
            out["top_logprobs"].append(dict(_top(position, top_n, decode)))
        else:
            out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[Mapping[int, Any] | None] | None,
                  top_n: int, decode: Decode) -> list[dict[str, Any]]:
    """The chat `logprobs.content` list for `token_ids`."""
    content: list[dict[str, Any]] = []
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        entry = position.get(tid) if position else None
        token = _token_text(tid, entry, decode) if entry is not None else decode(tid)
        tops = _top(position, top_n, decode) if position and top_n > 0 else []
        content.append({
            "token": token,
            "logprob": _finite(entry.logprob) if entry is not None else -9999.0,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in tops],
        })
    return content
