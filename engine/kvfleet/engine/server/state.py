"""What the HTTP handlers share: the engine once loaded, the keys, the metrics, and the
readiness / draining flags that /health and the middleware read."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from kvfleet.engine.async_llm import AsyncLLM
from kvfleet.engine.server.auth import ApiKeys
from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.limits import Admission
from kvfleet.engine.server.metrics import ServerMetrics
from kvfleet.engine.server.reasoning import ReasoningParser

logger = logging.getLogger("kvfleet.server")

ENCODE_INLINE_CHARS = 8192  # shorter texts tokenize in well under a millisecond: no thread hop
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)   # the tokenizer releases the GIL: long texts run in parallel

T = TypeVar("T")

# Used when the tokenizer has none: ChatML, the format of SmolLM2 and Qwen.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TemplateCall:
    """How a request's conversation is rendered, beside its messages."""

    add_generation_prompt: bool = True     # open the assistant's turn
    continue_final_message: bool = False   # or go on from the last message's text
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] | None = None   # the request's chat_template_kwargs


@dataclass
class ServerState:
    model_name: str
    model_path: str
    keys: ApiKeys | None
    max_queue_len: int | None = None
    chat_template: str | None = None
    log_requests: bool = True
    block_size: int = 16
    max_request_bytes: int = 32 * 2**20   # larger bodies get 413 before they are read
    metrics_port: int | None = None       # /metrics only there (and only /metrics there)
    tool_parser: str | None = None        # tool_choice "auto" is served, its calls read with this parser
    reasoning_parser: str | None = None   # --reasoning-parser: answers' thinking apart (bound to the tokenizer
    reasoning: ReasoningParser | None = None   # as `reasoning` once the model is loaded)
    engine: AsyncLLM | None = None   # once loaded
    ready: bool = False           # loaded and one step has run
    load_error: str | None = None
    draining: bool = False
    # Engine requests running now (ids), and whether the shutdown grace period ran out: then each of
    # them, and any that would still start, ends with a 503 (an error event in a stream).
    live_requests: set[str] = field(default_factory=set)
    cut_off: bool = False
    admission: Admission = field(default_factory=Admission)
    metrics: ServerMetrics = field(init=False)
    # Most characters one token stands for (textbound.py), set once the model is loaded; None: no bound.
    chars_per_token: int | None = None
    # Long texts are rendered and tokenized here, off the event loop and apart from other blocking work.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvfleet-tokenize"))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, self.engine_stats)

    def engine_stats(self) -> Mapping[str, Any] | None:
        return self.engine.stats() if self.ready and self.engine is not None else None

    def loaded_engine(self) -> AsyncLLM:
        """The engine, for handlers: requests reach them only once it is loaded (the middleware answers 503
        before)."""
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly.", code="loading",
                           headers={"Retry-After": "1"})
        return self.engine

    @property
    def tokenizer(self) -> Any:
        return self.loaded_engine().tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.loaded_engine().model_config.max_model_len)

    @property
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the whole KV cache holds (one sequence can never grow past it)."""
        stats = self.engine_stats()
        return int(stats["kv_blocks_total"]) * self.block_size if stats and "kv_blocks_total" in stats else None

    @property
    def vocab_size(self) -> int:
        return int(self.loaded_engine().model_config.vocab_size)

    @property
    def max_prompt_chars(self) -> int | None:
        """Longest text that could fit the context; longer ones are refused without tokenizing them."""
        return self.max_model_len * self.chars_per_token if self.chars_per_token else None

    def check_text_fits(self, text: str, field: str) -> None:
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise APIError(400, f"{field}: this model's maximum context length is {self.max_model_len} tokens, "
                                f"which hold at most {limit} characters with its tokenizer (at most "
                                f"{self.chars_per_token} a token), but the text has {len(text)} characters",
                           field, "invalid_value")

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:  # e.g. a config-only folder with --load-format dummy
            raise APIError(400, f"{field}: this model has no tokenizer; send token ids", field, "no_tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, after refusing a text too long to fit, and off the event loop for long texts: a
        megabyte of prompt takes ~0.6 s to tokenize, which would otherwise stall every other request,
        /health and /metrics meanwhile."""
        self.check_text_fits(text, field)
        if len(text) < ENCODE_INLINE_CHARS:
            return self.encode(text, field, add_special_tokens)
        return await self.off_loop(self.encode, text, field, add_special_tokens)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, functools.partial(fn, *args))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def decode_one(self, token_id: int) -> str:
        # Without a tokenizer, name the token the way vLLM's return_tokens_as_token_ids does.
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def render_chat(self, messages: list[dict[str, Any]], call: TemplateCall) -> str:
        tok = self.tokenizer
        if tok is None:
            raise APIError(400, "messages: this model has no tokenizer (and no chat template)", "messages",
                           "no_tokenizer")
        template = self.chat_template or getattr(tok, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=call.add_generation_prompt,
                                       continue_final_message=call.continue_final_message, tools=call.tools,
                                       **(call.kwargs or {}))
