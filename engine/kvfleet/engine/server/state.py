"""What the HTTP handlers share: the engine once loaded, the keys, the metrics, and the
readiness / draining flags that /health and the middleware read."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.limits import Admission
from kvfleet.engine.server.metrics import ServerMetrics

logger = logging.getLogger("kvfleet.server")

ENCODE_INLINE_CHARS = 8192  # shorter texts tokenize in well under a millisecond: no thread hop

# Used when the tokenizer has none: ChatML, the format of SmolLM2 and Qwen.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class ServerState:
    model_name: str
    model_path: str
    keys: Mapping[str, str] | None
    max_queue_len: int | None = None
    chat_template: str | None = None
    log_requests: bool = True
    block_size: int = 16
    max_request_bytes: int = 32 * 2**20   # larger bodies get 413 before they are read
    engine: Any = None            # AsyncLLM once loaded
    ready: bool = False           # loaded and one step has run
    load_error: str | None = None
    draining: bool = False
    admission: Admission = field(default_factory=Admission)
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, self.engine_stats)

    def engine_stats(self) -> Mapping[str, Any] | None:
        return self.engine.stats() if self.ready and self.engine is not None else None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.model_config.max_model_len)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the whole KV cache holds (one sequence can never grow past it)."""
        stats = self.engine_stats()
        return int(stats["kv_blocks_total"]) * self.block_size if stats and "kv_blocks_total" in stats else None

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model_config.vocab_size)

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:  # e.g. a config-only folder with --load-format dummy
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field, "no_tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` off the event loop for long texts: a megabyte of prompt takes ~0.6 s to tokenize,
        which would otherwise stall every other request, /health and /metrics meanwhile."""
        if len(text) < ENCODE_INLINE_CHARS:
            return self.encode(text, field, add_special_tokens)
        return await asyncio.to_thread(self.encode, text, field, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def decode_one(self, token_id: int) -> str:
        # Without a tokenizer, name the token the way vLLM's return_tokens_as_token_ids does.
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        if tok is None:
            raise APIError(400, "messages: this model has no tokenizer (and no chat template)", "messages",
                           "no_tokenizer")
        template = self.chat_template or getattr(tok, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
