"""Pure decisions about a request: token limits, sampling parameters, admission.

Everything here is a plain function of its arguments, so the rules are tested
without a server; the handlers turn a `RequestError` into a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvfleet.engine.core.inputs import token_outside_vocab
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.server.protocol import SamplingFields


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_prompt_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    if not ids:
        raise RequestError(f"{field}: the prompt is empty (it must hold at least one token)", field)
    bad = token_outside_vocab(ids, vocab_size)
    if bad is not None:
        raise RequestError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})", field)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       prompt_field: str, max_field: str, kv_capacity: int | None = None) -> int:
    """The output budget; a prompt or request that cannot fit the context is an error (like vLLM).
    Left unset, it is what fits both the context and the whole KV cache (which may be smaller than
    the context on a small device), so a request without max_tokens is never refused for it."""
    if prompt_len >= max_model_len:
        raise RequestError(
            f"{prompt_field}: this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens (no room for output)", prompt_field)
    room = max_model_len - prompt_len
    if kv_capacity is not None and prompt_len >= kv_capacity:
        # The prompt alone is the problem, whatever max_tokens says.
        raise RequestError(f"{prompt_field}: the prompt ({prompt_len} tokens) does not fit this server's KV cache "
                           f"({kv_capacity} tokens, no room for output)", prompt_field)
    if requested is None:
        if kv_capacity is not None and kv_capacity - prompt_len < room:
            room = kv_capacity - prompt_len
        return room
    if requested > room:
        raise RequestError(
            f"{max_field}: this model's maximum context length is {max_model_len} tokens; you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the output)", max_field)
    if kv_capacity is not None and prompt_len + requested > kv_capacity:
        raise RequestError(
            f"{max_field}: this server's KV cache holds {kv_capacity} tokens in all; you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the output)", max_field)
    return requested


def sampling_kwargs(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    tool_constraint: StructuredOutputsParams | None = None) -> dict[str, Any]:
    """`SamplingParams(**kwargs)` for a request; unset OpenAI fields keep the engine's defaults. `tool_constraint`:
    a named or required tool choice's structured output (the request has no other)."""
    kwargs: dict[str, Any] = {
        "n": req.n,
        "max_tokens": max_tokens,
        "min_tokens": min(req.min_tokens, max_tokens),
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    if req.min_tokens > max_tokens:
        raise RequestError(f"min_tokens: must be <= max_tokens ({max_tokens}), got {req.min_tokens}", "min_tokens")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = float(value)
    if req.top_k is not None:
        kwargs["top_k"] = -1 if req.top_k == 0 else req.top_k  # 0 means "disabled", as in vLLM/OpenAI SDKs
    if any(s == "" for s in kwargs["stop"]):
        raise RequestError("stop: stop strings must be non-empty", "stop")
    if req.logit_bias:
        kwargs["logit_bias"] = logit_bias_ids(req.logit_bias)
    if req.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        kwargs["bad_words"] = list(req.bad_words)
    structured = tool_constraint or structured_outputs_params(req)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return kwargs


def structured_outputs_params(req: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint a request asks for: OpenAI's JSON `response_format` or vLLM's `structured_outputs`."""
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None   # the shape requires it with this type
        schema = fmt.json_schema.schema_
        return StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    so = req.structured_outputs
    if so is None:
        return None
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                   json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)


# What the engine's structured-output errors name, as a request with a JSON response_format spelled it.
_RESPONSE_FORMAT_SPELLING = (("structured_outputs.json_object", "response_format"),
                             ("structured_outputs.json", "response_format.json_schema.schema"),
                             ("structured_outputs", "response_format"))


def structured_outputs_error(message: str, req: SamplingFields, via_tools: bool = False) -> tuple[str, str] | None:
    """(message, param) for an engine error about the request's constraint, in the request's own words (`via_tools`:
    the constraint is a tool choice's); None if the error is about something else."""
    if not message.startswith("structured_outputs"):
        return None
    if via_tools:
        return "tools: a function's parameters" + message[message.find(":"):], "tools"
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return message, "structured_outputs"
    for engine_name, sent_name in _RESPONSE_FORMAT_SPELLING:
        if message.startswith(engine_name + ":") or message.startswith(engine_name + "."):
            return sent_name + message[len(engine_name):], "response_format"
    return message, "response_format"


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON keys) with int keys; the values' range is SamplingParams'."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias: keys must be token ids (decimal integers), got {key!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


@dataclass
class Admission:
    """Counts of accepted requests: `waiting` = no first output yet, `inflight` = not finished."""

    waiting: int = 0
    inflight: int = 0

    def ticket(self) -> "Ticket":
        return Ticket(self)


class Ticket:
    """One accepted engine request's place in the counts, taken synchronously when the handler
    admits it (so concurrent handlers see each other) and released exactly once."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._waiting = True
        self._open = True
        admission.waiting += 1
        admission.inflight += 1

    def started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._admission.waiting -= 1

    def release(self) -> None:
        self.started()
        if self._open:
            self._open = False
            self._admission.inflight -= 1


def admit(waiting: int, incoming: int, max_queue_len: int | None) -> bool:
    """May `incoming` more requests join a queue of `waiting`? A lone request is never refused
    when the queue is empty, so a batch larger than the limit still runs on an idle server."""
    if max_queue_len is None:
        return True
    return waiting == 0 or waiting + incoming <= max_queue_len


def retry_after_seconds(waiting: int, max_queue_len: int) -> int:
    """A hint for 429's Retry-After: longer the further over the limit we are (1..30 s)."""
    return max(1, min(30, 1 + waiting // max(1, max_queue_len)))
