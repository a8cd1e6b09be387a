"""POST /v1/completions: one engine request per prompt, `n` choices each."""

from __future__ import annotations

import time
from typing import Any, AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvfleet.engine.server.errors import APIError, error_body
from kvfleet.engine.server.generation import ClientGone, last_outputs, merge_streams, new_request_id, stream_request
from kvfleet.engine.server.logprobs import completion_logprobs
from kvfleet.engine.server.protocol import CompletionRequest
from kvfleet.engine.server.serving import (
    SSE_DONE,
    ManagedStream,
    TextChunks,
    build_inputs_async,
    check_model,
    release_all,
    sse,
    take_tickets,
    usage,
)
from kvfleet.engine.server.state import ServerState, logger


async def _prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt of a str / ids / list[str] / list[ids] field."""
    if isinstance(prompt, str):
        return [(prompt, await state.encode_async(prompt, "prompt"))]
    if prompt and isinstance(prompt[0], int):
        return [(None, list(prompt))]
    return [(p, await state.encode_async(p, "prompt")) if isinstance(p, str) else (None, list(p)) for p in prompt]


def prompt_texts(state: ServerState, prompts: list[tuple[str | None, list[int]]], echo: bool) -> list[str]:
    """Each prompt's text for the answer: as sent, or a token-id prompt's decoded, which only `echo` shows (a
    1k-token prompt takes ~0.3 ms to decode on the event loop: issue 16, the burst's intake)."""
    return [text if text is not None else (state.decode(ids) if echo else "") for text, ids in prompts]


def _choice_logprobs(state: ServerState, req: CompletionRequest, out: Any, completion: Any,
                     prompt_text: str) -> dict[str, Any] | None:
    if req.logprobs is None:
        return None
    decode = state.decode_one
    if req.echo:
        prompt_part = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, req.logprobs, decode)
        gen = completion_logprobs(completion.token_ids, completion.logprobs, req.logprobs, decode,
                                  text_offset=len(prompt_text))
        return {k: prompt_part[k] + gen[k] for k in gen}
    return completion_logprobs(completion.token_ids, completion.logprobs, req.logprobs, decode)


async def create_completion(state: ServerState, req: CompletionRequest, request: Request, tenant: str) -> Response:
    model = check_model(state, req.model)
    prompts = await _prompts(state, req.prompt)
    field = "prompt"
    want_prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
    inputs = [await build_inputs_async(state, req, ids, req.max_tokens, field, "max_tokens", req.logprobs,
                                       want_prompt_lp, text) for text, ids in prompts]
    texts = prompt_texts(state, prompts, req.echo)
    tickets = take_tickets(state, len(prompts), tenant)
    request_id = new_request_id("cmpl")
    streams = [stream_request(state, tickets[i], inputs[i], f"{request_id}-{i}", tenant) for i in range(len(prompts))]
    created = int(time.time())
    if req.stream:
        body = _stream(state, req, streams, texts, request_id, model, created)
        return ManagedStream(body, on_close=lambda: release_all(tickets))
    try:
        finals = await last_outputs(streams, request)
    except ClientGone:
        return Response(status_code=499)
    finally:
        release_all(tickets)
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        for completion in out.outputs:
            completion_tokens += len(completion.token_ids)
            text = (texts[i] + completion.text) if req.echo else completion.text
            choices.append({"index": i * req.n + completion.index, "text": text,
                            "logprobs": _choice_logprobs(state, req, out, completion, texts[i]),
                            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


async def _stream(state: ServerState, req: CompletionRequest, streams: list[AsyncGenerator[Any, None]],
                  texts: list[str], request_id: str, model: str, created: int) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options and req.stream_options.continuous_usage_stats)
    plain = TextChunks(request_id, "text_completion", created, model)
    try:
        async for i, out in merge_streams(streams):
            prompt_tokens[i] = len(out.prompt_token_ids)
            for completion in out.outputs:
                index = i * req.n + completion.index
                if index in finished:
                    continue
                start_text, start_tok = sent_text.get(index), sent_tokens.get(index, 0)
                delta = completion.text[start_text or 0:]
                new_ids = completion.token_ids[start_tok:]
                if start_text is None and req.echo:
                    delta = texts[i] + delta
                if not delta and not new_ids and completion.finish_reason is None:
                    continue
                sent_text[index] = len(completion.text)
                sent_tokens[index] = len(completion.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    positions = (completion.logprobs or [])[start_tok:]
                    logprobs = completion_logprobs(new_ids, positions, req.logprobs, state.decode_one)
                if completion.finish_reason is not None:
                    finished.add(index)
                elif logprobs is None and not continuous and completion.stop_reason is None:
                    yield plain.text(index, delta)   # the same bytes as sse(chunk) below, for a fraction of the cost
                    continue
                chunk: dict[str, Any] = {
                    "id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": delta, "logprobs": logprobs,
                                 "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}]}
                if continuous:
                    chunk["usage"] = usage(sum(prompt_tokens.values()), sum(sent_tokens.values()))
                yield sse(chunk)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(sum(prompt_tokens.values()), sum(sent_tokens.values()))})
    except APIError as exc:  # headers are sent: report in-band, then end the stream
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception:
        logger.exception("completion stream %s failed", request_id)
        yield sse(error_body(500, "Internal error while streaming", code="internal_error"))
    yield SSE_DONE
