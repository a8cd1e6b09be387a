"""A prompt's prefix as a chain of block hashes (pure), what routing matches replicas on.

The gateway has no tokenizer, so a text prompt is cut into blocks of `block_chars` characters
(about `block_chars / 4` tokens); a token-id prompt into blocks of `block_tokens` ids. Like the
engine's prefix cache, only full blocks count and each block's hash covers every block before it,
so two prompts share the first k hashes exactly when they share the first k blocks. Only the first
`max_blocks` blocks are hashed: a prefix longer than that is as good as one that long.

A chat request's text is its messages in order, each as role and content with separators no text
contains: it stands in for the chat template, which the gateway does not have, and shares a prefix
exactly when the rendered prompts do. A Responses request's text is its conversation written the same way
(`responses_api.turns`: the instructions as the system message, then the input's items in order), so a
conversation of messages shares its prefix with the same conversation sent as a chat.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from kvfleet.engine.server.protocol import ChatCompletionRequest
from kvfleet.engine.server.protocol_responses import ResponsesRequest
from kvfleet.gateway.requests import Generation
from kvfleet.gateway.responses_api import turns


@dataclass(frozen=True)
class PrefixConfig:
    block_chars: int = 256
    block_tokens: int = 64
    max_blocks: int = 64


def _chain(blocks: Sequence[bytes]) -> tuple[int, ...]:
    out = []
    prev = b""
    for block in blocks:
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return tuple(out)


def text_hashes(text: str, cfg: PrefixConfig) -> tuple[int, ...]:
    n = min(len(text) // cfg.block_chars, cfg.max_blocks)
    size = cfg.block_chars
    return _chain([text[i * size:(i + 1) * size].encode("utf-8", "surrogatepass") for i in range(n)])


def token_hashes(ids: Sequence[int], cfg: PrefixConfig) -> tuple[int, ...]:
    n = min(len(ids) // cfg.block_tokens, cfg.max_blocks)
    size = cfg.block_tokens
    return _chain([b"\x00".join(str(t).encode() for t in ids[i * size:(i + 1) * size]) for i in range(n)])


def chat_text(req: ChatCompletionRequest) -> str:
    return "".join(f"\x1e{m.role}\x1f{m.text()}" for m in req.messages)


def responses_text(req: ResponsesRequest) -> str:
    return "".join(f"\x1e{t.role}\x1f{t.text}" for t in turns(req))


def request_hashes(req: Generation, cfg: PrefixConfig) -> tuple[int, ...]:
    """The block hashes of a request's prompt (the first prompt of a batch of prompts)."""
    if isinstance(req, ChatCompletionRequest):
        return text_hashes(chat_text(req), cfg)
    if isinstance(req, ResponsesRequest):
        return text_hashes(responses_text(req), cfg)
    prompt = req.prompt
    if isinstance(prompt, str):
        return text_hashes(prompt, cfg)
    first = prompt[0]
    if isinstance(first, int):
        return token_hashes(prompt, cfg)  # type: ignore[arg-type]
    if isinstance(first, str):
        return text_hashes(first, cfg)
    return token_hashes(first, cfg)
