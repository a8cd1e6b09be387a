"""POST /v1/chat/completions: the tokenizer's chat template, then one engine request with `n` choices; tool calls
read from the answers (kvfleet.engine.server.tools)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, AsyncGenerator, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.server.errors import APIError, error_body
from kvfleet.engine.server.generation import ClientGone, last_outputs, merge_streams, new_request_id, stream_request
from kvfleet.engine.server.limits import Ticket
from kvfleet.engine.server.logprobs import chat_logprobs
from kvfleet.engine.server.protocol import ChatCompletionRequest, ChatMessage
from kvfleet.engine.server.reasoning import ReasoningReader, ReasoningSplit
from kvfleet.engine.server.serving import (
    SSE_DONE,
    ManagedStream,
    build_inputs_async,
    check_model,
    release_all,
    sse,
    take_tickets,
    usage,
)
from kvfleet.engine.server.state import ENCODE_INLINE_CHARS, ServerState, TemplateCall, logger
from kvfleet.engine.server.tools import (
    ToolChoiceError,
    ToolMode,
    finish_reason_with_calls,
    new_call_id,
    parse_answer,
    streamable_prefix,
    streamed_content,
    template_messages,
    template_tools,
    tool_constraint,
    tool_mode,
)


async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], call: TemplateCall) -> list[int]:
    """Render the chat template (with the request's tools and template variables) and tokenize it (the template
    already holds any BOS token)."""
    conversation = template_messages(messages)
    size = sum(len(m["content"]) for m in conversation)
    try:
        if size < ENCODE_INLINE_CHARS:
            text = state.render_chat(conversation, call)
        else:   # a template copies long contents around: off the event loop too
            text = await state.off_loop(state.render_chat, conversation, call)
    except APIError:
        raise
    except Exception as exc:  # a template may raise for conversations it does not support
        raise APIError(400, f"messages: the chat template cannot render this conversation: {exc}", "messages",
                       "invalid_messages") from None
    return await state.encode_async(text, "messages", add_special_tokens=False)


def _logprobs(state: ServerState, req: ChatCompletionRequest, token_ids: list[int],
              positions: Any) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    return {"content": chat_logprobs(token_ids, positions, req.top_logprobs or 0, state.decode_one)}


@dataclasses.dataclass
class ChatRun:
    """A chat request admitted and started in the engine: what reading its answer needs."""

    req: ChatCompletionRequest
    mode: ToolMode
    reader: ReasoningReader | None
    streams: list[AsyncGenerator[Any, None]]
    tickets: list[Ticket]
    request_id: str
    model: str
    created: int

    def release(self) -> None:
        release_all(self.tickets)


async def start_chat(state: ServerState, req: ChatCompletionRequest, tenant: str,
                     id_prefix: str = "chatcmpl") -> ChatRun:
    """Check a chat request (400s name its fields), render and tokenize it, admit it and start it in the engine."""
    model = check_model(state, req.model)
    try:
        mode = tool_mode(req.tools, req.tool_choice, state.tool_parser, req.parallel_tool_calls)
    except ToolChoiceError as exc:
        raise APIError(400, str(exc), "tool_choice", "invalid_value") from None
    # the call tag or the thinking markers are special tokens: the answer is decoded with them (vLLM's rule)
    special_markers = state.reasoning is not None and state.reasoning.fmt.special_markers
    if (mode.keeps_special_tokens or special_markers) and req.skip_special_tokens:
        req = req.model_copy(update={"skip_special_tokens": False})
    ids = await chat_prompt_ids(state, req.messages, TemplateCall(
        req.add_generation_prompt, req.continue_final_message, template_tools(req.tools), req.chat_template_kwargs))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    constraint = tool_constraint(req.tools or [], mode, req.parallel_tool_calls)
    inputs = await build_inputs_async(state, req, ids, requested, "messages", max_field, logprobs,
                                      tool_constraint=constraint)
    reader = None
    if state.reasoning is not None:
        reader = state.reasoning.reader(ids)
        if inputs.grammar is not None:   # the constraint is the answer's, after the thinking
            inputs = dataclasses.replace(inputs, grammar=state.reasoning.gate(inputs.grammar, reader.start))
    tickets = take_tickets(state, 1, tenant)
    request_id = new_request_id(id_prefix)
    streams = [stream_request(state, tickets[0], inputs, request_id, tenant)]
    return ChatRun(req, mode, reader, streams, tickets, request_id, model, int(time.time()))


@dataclasses.dataclass(frozen=True)
class ChatResult:
    """A finished chat request: the chat completion's body, and the engine's output it was made of."""

    body: dict[str, Any]
    output: RequestOutput


async def chat_result(state: ServerState, run: ChatRun, request: Request) -> ChatResult:
    """The whole answer of a started chat (ClientGone if the client left first); releases its admission."""
    try:
        (out,) = await last_outputs(run.streams, request)
    finally:
        run.release()
    req = run.req
    choices = [{"index": c.index, **_answer(run.mode, run.reader, c.text, c.finish_reason),
                "logprobs": _logprobs(state, req, c.token_ids, c.logprobs), "stop_reason": c.stop_reason}
               for c in out.outputs]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": run.request_id, "object": "chat.completion", "created": run.created, "model": run.model,
            "choices": choices, "usage": usage(len(out.prompt_token_ids), completion_tokens)}
    return ChatResult(body, out)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request,
                                 tenant: str) -> Response:
    run = await start_chat(state, req, tenant)
    if req.stream:
        return ManagedStream(_stream(chat_chunks(state, run)), on_close=run.release)
    try:
        result = await chat_result(state, run, request)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(result.body)


def _answer(mode: ToolMode, reader: ReasoningReader | None, text: str,
            finish_reason: str | None) -> dict[str, Any]:
    """A choice's message and finish_reason: its thinking (with a reasoning parser), and its text or the tool
    calls read from the answer after the thinking."""
    split = reader.split(text, final=True) if reader is not None else ReasoningSplit(None, text)
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if reader is not None:
        message["reasoning"] = split.reasoning
    if split.content is None:   # cut off while thinking
        return {"message": message, "finish_reason": finish_reason}
    answer = parse_answer(split.content, mode, complete=finish_reason == "stop")
    message["content"] = answer.content
    if not answer.tool_calls:
        return {"message": message, "finish_reason": finish_reason}
    message["tool_calls"] = [call.to_openai(new_call_id(mode)) for call in answer.tool_calls]
    return {"message": message, "finish_reason": finish_reason_with_calls(mode, finish_reason)}


@dataclasses.dataclass(frozen=True)
class Sent:
    """How much of a choice a stream has sent: characters of its thinking, and of its answer's text."""

    reasoning: int = 0
    content: int = 0


def stream_delta(mode: ToolMode, reader: ReasoningReader | None, text: str, sent: Sent, finish_reason: str | None,
           new_tokens: bool) -> tuple[dict[str, Any], str | None, Sent] | None:
    """What a stream sends of a choice now: (delta, finish_reason, what is sent by then); None: nothing yet.
    Thinking goes as `reasoning`; with tools, the answer's content goes as far as it is surely no call, and the
    calls go whole at the end."""
    final = finish_reason is not None
    split = reader.split(text, final) if reader is not None else ReasoningSplit(None, text)
    thought = (split.reasoning or "")[sent.reasoning:]
    body: dict[str, Any] = {"reasoning": thought} if thought else {}
    answer = split.content
    if final and mode.kind != "none":
        if answer is not None:   # (None: cut off while thinking)
            parsed = parse_answer(answer, mode, complete=finish_reason == "stop")
            rest = streamed_content(answer, mode, parsed)[sent.content:]
            if rest:
                body["content"] = rest
            if parsed.tool_calls:
                body["tool_calls"] = [call.to_openai(new_call_id(mode), i) for i, call in enumerate(parsed.tool_calls)]
                finish_reason = finish_reason_with_calls(mode, finish_reason)
        return body, finish_reason, Sent(sent.reasoning + len(thought), len(answer or ""))
    sendable = streamable_prefix(answer, mode) if answer is not None else ""
    if sendable[sent.content:]:
        body["content"] = sendable[sent.content:]
    now = Sent(sent.reasoning + len(thought), len(sendable))
    if mode.kind != "none":
        return (body, None, now) if body else None
    if not body and not new_tokens and not final:
        return None
    # tokens without text yet (a character cut between tokens) still carry their logprobs
    return (body or ({"content": ""} if new_tokens else {})), finish_reason, now


def _chunk(request_id: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices}


async def _stream(chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    async with contextlib.aclosing(chunks):   # a client that leaves closes the engine's stream now, not at GC
        async for chunk in chunks:
            yield sse(chunk)
    yield SSE_DONE


async def chat_chunks(state: ServerState, run: ChatRun,
                      observe: Callable[[RequestOutput], None] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """A started chat's stream: its chunks, the usage chunk if asked for, an error body if it failed. `observe` is
    shown each engine output before the chunks made of it."""
    req, mode, reader = run.req, run.mode, run.reader
    request_id, model, created = run.request_id, run.model, run.created
    sent: dict[int, Sent] = {}
    sent_tokens: dict[int, int] = {}      # tokens generated so far (usage)
    logprobs_sent: dict[int, int] = {}    # tokens whose logprobs were sent: a chunk held back (a possible tool
    #                                       call) passes its tokens' logprobs on to the next one sent
    finished: set[int] = set()
    prompt_tokens = 0
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(include_usage and req.stream_options and req.stream_options.continuous_usage_stats)
    try:
        # The first chunk of every choice carries the role, as OpenAI's does.
        yield _chunk(request_id, model, created, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(req.n)])
        async for _, out in merge_streams(run.streams):
            if observe is not None:
                observe(out)
            prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                if c.index in finished:
                    continue
                new_tokens = len(c.token_ids) > sent_tokens.get(c.index, 0)
                step = stream_delta(mode, reader, c.text, sent.get(c.index, Sent()), c.finish_reason, new_tokens)
                sent_tokens[c.index] = len(c.token_ids)
                if step is None:
                    continue
                body, finish_reason, sent[c.index] = step
                if c.finish_reason is not None:
                    finished.add(c.index)
                lp_start = logprobs_sent.get(c.index, 0)
                logprobs_sent[c.index] = len(c.token_ids)
                chunk = _chunk(request_id, model, created, [{
                    "index": c.index, "delta": body,
                    "logprobs": _logprobs(state, req, c.token_ids[lp_start:], (c.logprobs or [])[lp_start:]),
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}])
                if continuous:
                    chunk["usage"] = usage(prompt_tokens, sum(sent_tokens.values()))
                yield chunk
        if include_usage:
            final = _chunk(request_id, model, created, [])
            final["usage"] = usage(prompt_tokens, sum(sent_tokens.values()))
            yield final
    except APIError as exc:
        yield error_body(exc.status, exc.message, exc.param, exc.code)
    except Exception:
        logger.exception("chat stream %s failed", request_id)
        yield error_body(500, "Internal error while streaming", code="internal_error")
