"""Steps shared by the completion and chat handlers: model check, parameters, admission, SSE."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfleet.engine.llm_engine import EngineInputs
from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvfleet.engine.server.errors import APIError, value_error_param
from kvfleet.engine.server.generation import REQUEST_FIELDS
from kvfleet.engine.server.limits import (
    RequestError,
    Ticket,
    admit,
    check_prompt_ids,
    resolve_max_tokens,
    retry_after_seconds,
    sampling_kwargs,
    structured_outputs_error,
    structured_outputs_params,
)
from kvfleet.engine.server.protocol import SamplingFields
from kvfleet.engine.server.state import ServerState

SSE_DONE = "data: [DONE]\n\n"
_ENCODER = json.JSONEncoder(ensure_ascii=False)   # json.dumps with keyword arguments builds one per call
_encode_str = json.encoder.encode_basestring        # a str as JSON, non-ASCII kept: what _ENCODER does to it


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_ENCODER.encode(payload)}\n\n"


class TextChunks:
    """The SSE event of a streamed completion chunk that carries only text (no logprobs, not finished, no
    usage): every token but the last of a plain stream. The same string as ``sse(chunk)``, but the constant
    head (id, object, created, model) is encoded once per stream and only the text per token: the chunk's
    JSON encoding was most of the HTTP path's host time per token (bench/http_token_path.py)."""

    def __init__(self, request_id: str, object_name: str, created: int, model: str) -> None:
        head = _ENCODER.encode({"id": request_id, "object": object_name, "created": created, "model": model})
        self._head = f'data: {head[:-1]}, "choices": [{{"index": '

    def text(self, index: int, text: str) -> str:
        return (f'{self._head}{index}, "text": {_encode_str(text)}, "logprobs": null, "finish_reason": null, '
                f'"stop_reason": null}}]}}\n\n')


def check_model(state: ServerState, model: str | None) -> str:
    """The served name; a request naming another model gets 404 (as OpenAI and vLLM answer)."""
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                       "model", "model_not_found")
    return state.model_name


def build_inputs(state: ServerState, req: SamplingFields, prompt_ids: list[int], requested_max: int | None,
                 prompt_field: str, max_field: str, logprobs: int | None,
                 prompt_logprobs: int | None = None, prompt_text: str | None = None,
                 tool_constraint: StructuredOutputsParams | None = None) -> EngineInputs:
    """One prompt's request with validated SamplingParams, checked by the engine's own rules as well (once:
    `AsyncLLM.generate` takes it as it is); any problem is a 400 naming the field."""
    try:
        # Length first: an over-long list of token ids is refused before each id is looked at.
        max_tokens = resolve_max_tokens(requested_max, len(prompt_ids), state.max_model_len, prompt_field,
                                        max_field, state.kv_capacity_tokens)
        check_prompt_ids(prompt_ids, state.vocab_size, prompt_field)
        kwargs = sampling_kwargs(req, max_tokens, logprobs, prompt_logprobs, tool_constraint)
        params = SamplingParams(**kwargs).validate(state.vocab_size)
    except RequestError as exc:
        raise APIError(400, exc.message, exc.param, "invalid_value") from None
    except ValueError as exc:  # SamplingParams.validate: "field: reason"
        message = str(exc)
        structured = structured_outputs_error(message, req, tool_constraint is not None)
        if structured is not None:
            raise APIError(400, structured[0], structured[1], "invalid_value") from None
        field = message.split(":", 1)[0].strip()
        raise APIError(400, message, field if field.isidentifier() else None, "invalid_value") from None
    return check_engine_inputs(state, req, prompt_ids, params, prompt_field, max_field, prompt_text,
                               tool_constraint is not None)


async def build_inputs_async(state: ServerState, req: SamplingFields, prompt_ids: list[int],
                             requested_max: int | None, prompt_field: str, max_field: str, logprobs: int | None,
                             prompt_logprobs: int | None = None, prompt_text: str | None = None,
                             tool_constraint: StructuredOutputsParams | None = None) -> EngineInputs:
    """`build_inputs`, off the event loop for a request with structured outputs: compiling its constraint takes
    milliseconds, and the first one builds the tokenizer's token table (about a second)."""
    args = (state, req, prompt_ids, requested_max, prompt_field, max_field, logprobs, prompt_logprobs, prompt_text,
            tool_constraint)
    if tool_constraint is None and structured_outputs_params(req) is None:
        return build_inputs(*args)
    return await state.off_loop(build_inputs, *args)


def check_engine_inputs(state: ServerState, req: SamplingFields, prompt_ids: list[int], params: SamplingParams,
                        prompt_field: str, max_field: str, prompt_text: str | None = None,
                        via_tools: bool = False) -> EngineInputs:
    """The engine's own admission rules (n or best_of over max_num_seqs, a request that can never fit the
    KV cache, a constraint that does not compile, ...), checked now: once a stream has sent its headers an error
    could only go in-band under a 200."""
    try:
        return state.loaded_engine().process_inputs({"prompt": prompt_text, "prompt_token_ids": prompt_ids}, params)
    except ValueError as exc:
        message = str(exc)
        structured = structured_outputs_error(message, req, via_tools)
        if structured is not None:
            raise APIError(400, structured[0], structured[1], "invalid_value") from None
        param = value_error_param(message, REQUEST_FIELDS)
        named = param
        if param in ("prompt", "prompt_token_ids"):
            param = prompt_field
        elif param == "max_tokens":
            param = max_field
        if named and param and param != named and message.startswith(named + ":"):
            message = param + message[len(named):]  # the field as this request spelled it
        raise APIError(400, message, param, "invalid_value") from None


def take_tickets(state: ServerState, count: int, tenant: str) -> list[Ticket]:
    """Admit `count` engine requests or answer 429 (queue full) / 503 (draining)."""
    if state.draining:
        state.metrics.observe_rejected(tenant, "draining")
        raise APIError(503, "The server is shutting down; retry on another replica.", code="draining",
                       headers={"Retry-After": "1", "Connection": "close"})
    waiting = state.admission.waiting
    if not admit(waiting, count, state.max_queue_len):
        state.metrics.observe_rejected(tenant, "queue_full")
        assert state.max_queue_len is not None
        retry = retry_after_seconds(waiting, state.max_queue_len)
        raise APIError(429, f"Too many requests waiting ({waiting} queued, limit {state.max_queue_len}); "
                            f"retry after {retry} s.", code="queue_full", headers={"Retry-After": str(retry)})
    return [state.admission.ticket() for _ in range(count)]


def release_all(tickets: Sequence[Ticket]) -> None:
    for ticket in tickets:
        ticket.release()


class ManagedStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends, even if the body never started
    (a client that leaves before the first byte)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
