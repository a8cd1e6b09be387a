"""POST /v1/responses: OpenAI's Responses API, served by the chat path (kvfleet.engine.server.chat).

A request becomes a chat request (`instructions` a system message, `input` items messages: an earlier answer's
function calls an assistant message's tool calls, their outputs tool messages, its reasoning the thinking of the
assistant turn after it), runs as one, and its answer is told as Responses output items: the thinking as a
`reasoning` item, the text as a `message` with one `output_text` part, each tool call as a `function_call` item.
Streams send OpenAI's events (`response.created` ... `response.completed`), named on their `event:` lines.
Errors name the Responses fields (`input`, `max_output_tokens`, `text.format` ...), never the chat ones.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvfleet.engine.outputs import RequestOutput
from kvfleet.engine.server.chat import ChatRun, chat_chunks, chat_result, start_chat
from kvfleet.engine.server.error_shapes import describe_validation_errors
from kvfleet.engine.server.errors import APIError
from kvfleet.engine.server.generation import ClientGone
from kvfleet.engine.server.protocol import ChatCompletionRequest
from kvfleet.engine.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    content_text,
)
from kvfleet.engine.server.serving import ManagedStream
from kvfleet.engine.server.state import ServerState

# A chat field an error names -> the Responses field it came from (`param`; messages name the full path).
RESPONSES_FIELD = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "response_format": "text", "logprobs": "top_logprobs", "chat_template_kwargs": "reasoning"}
# Fields that mean the same in both APIs and pass as they are.
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop", "stop_token_ids", "ignore_eos"}
RESPONSES_PATH = {"response_format.json_schema": "text.format", "response_format": "text.format"}


# --- the request, as a chat request (pure) -------------------------------------------------
def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: instructions first, then the input items in order."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    thinking: list[str] = []   # reasoning items not yet shown with an assistant turn
    for item in req.input:
        if isinstance(item, ReasoningItem):
            thinking.extend(part.text for part in (item.content or item.summary))
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)})
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)   # the same turn: its text, then its calls
                continue
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            assert isinstance(item, MessageItem)
            message = {"role": item.role, "content": content_text(item.content)}
        if message["role"] == "assistant" and thinking:
            message["reasoning"] = "\n".join(thinking)
            thinking = []
        messages.append(message)
    return messages


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req` (its stream always ends with usage: the last event carries it)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls,
                            "user": req.user}
    body.update(req.model_dump(include=SAMPLING_FIELDS, exclude_none=True))
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            include={"name", "schema_", "description", "strict"}, by_alias=True, exclude_none=True)}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if req.wants_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param, code = describe_validation_errors(exc.errors())
        raise responses_error(APIError(400, message, param, code)) from None


def responses_error(exc: APIError) -> APIError:
    """The same error, naming the Responses field where it named a chat one."""
    param = RESPONSES_FIELD.get(exc.param or "", exc.param)
    message = exc.message
    for chat_name, name in {**RESPONSES_PATH, **RESPONSES_FIELD}.items():
        for form in (f"{chat_name}:", f"{chat_name}.", f"'{chat_name}'", f"{chat_name}["):
            at = message.find(form)
            if at >= 0 and (at == 0 or message[at - 1] in " '"):
                message = message[:at] + form.replace(chat_name, name) + message[at + len(form):]
                break
    return APIError(exc.status, message, param, exc.code, headers=exc.headers)


# --- the answer, as Responses output (pure) ------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": "completed"}


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None,
                 status: Literal["completed", "incomplete", "in_progress"]) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part] if status != "in_progress" else []}


def function_call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if status == "completed" else "", "status": status}


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int, thinking_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": thinking_tokens},
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class ResponseHead:
    """What every form of one response says of the request: its id, time, model and the settings it ran with."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionToolChoice) else (
            req.tool_choice or ("auto" if req.tools else "none"))
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False, "temperature": req.temperature, "text": {"format": text_format},
            "tool_choice": tool_choice, "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs, "top_p": req.top_p, "truncation": "disabled", "usage": usage,
            "user": req.user, "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            "service_tier": req.service_tier or "default",
        }


def status_of(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: dict[str, Any], finish_reason: str | None,
                 logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A chat answer's message as output items: thinking, text, calls, in the order the model wrote them."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning"):
        items.append(reasoning_item(_item_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        items.append(message_item(_item_id("msg"), content, logprobs, status_of(finish_reason)))
    items.extend(function_call_item(_item_id("fc"), call) for call in calls)
    return items


# --- a stream's events (pure) --------------------------------------------------------------
@dataclass
class _Open:
    """The output item a stream is writing now."""

    kind: Literal["reasoning", "message"]
    item_id: str
    index: int
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class ResponseEvents:
    """Turns a chat stream's chunks into Responses events, numbered in order; the items told so far make the
    final response."""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.items: list[dict[str, Any]] = []
        self.usage: dict[str, int] | None = None
        self.finish_reason: str | None = None
        self._open: _Open | None = None
        self._pending_logprobs: list[dict[str, Any]] = []   # of tokens whose text is not sent yet
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        body = self.head.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (its choice's delta; a usage-only chunk is kept for the end)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk.get("choices"):
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        logprobs = choice.get("logprobs")
        if logprobs and logprobs.get("content"):
            self._pending_logprobs.extend(logprobs["content"])
        if delta.get("reasoning"):
            events += self._write("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        if delta.get("tool_calls"):
            events += self._close()
            for call in delta["tool_calls"]:
                events += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            events += self._close()
        return events

    def _write(self, kind: Literal["reasoning", "message"], text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is not None and self._open.kind != kind:
            events += self._close()
        if self._open is None:
            self._open = _Open(kind, _item_id("rs" if kind == "reasoning" else "msg"), len(self.items))
            events += self._opened(self._open)
        item = self._open
        item.text += text
        where = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", delta=text, **where))
        else:
            tokens, self._pending_logprobs = self._pending_logprobs, []
            item.logprobs += tokens
            events.append(self._event("response.output_text.delta", delta=text, logprobs=tokens, **where))
        return events

    def _opened(self, item: _Open) -> list[dict[str, Any]]:
        where = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            shell: dict[str, Any] = {"type": "reasoning", "id": item.item_id, "summary": [], "content": [],
                                     "encrypted_content": None, "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            shell = message_item(item.item_id, "", None, "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=item.index, item=shell),
                self._event("response.content_part.added", part=part, **where)]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item.item_id, "output_index": item.index, "content_index": 0}
        if item.kind == "reasoning":
            done = reasoning_item(item.item_id, item.text)
            events = [self._event("response.reasoning_text.done", text=item.text, **where),
                      self._event("response.content_part.done", part=done["content"][0], **where)]
        else:
            item.logprobs += self._pending_logprobs
            self._pending_logprobs = []
            done = message_item(item.item_id, item.text, item.logprobs, status_of(self.finish_reason))
            events = [self._event("response.output_text.done", text=item.text, logprobs=item.logprobs, **where),
                      self._event("response.content_part.done", part=done["content"][0], **where)]
        self.items.append(done)
        return events + [self._event("response.output_item.done", output_index=item.index, item=done)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index, item_id = len(self.items), _item_id("fc")
        done = function_call_item(item_id, call)
        where = {"item_id": item_id, "output_index": index}
        self.items.append(done)
        return [self._event("response.output_item.added", output_index=index,
                            item=function_call_item(item_id, call, "in_progress")),
                self._event("response.function_call_arguments.delta", delta=done["arguments"], **where),
                self._event("response.function_call_arguments.done", arguments=done["arguments"], name=done["name"],
                            **where),
                self._event("response.output_item.done", output_index=index, item=done)]

    def end(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The last event: the whole response, with its usage."""
        events = self._close()
        status = status_of(self.finish_reason)
        body = self.head.body(status, self.items, usage)
        return events + [self._event(f"response.{status}", response=body)]

    def error(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """A stream that failed: OpenAI's `error` event (what was sent stays sent)."""
        return [self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param"))]


def sse_event(event: dict[str, Any]) -> str:
    """An event as the Responses API sends it: its type on the `event:` line."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# --- the endpoint --------------------------------------------------------------------------
@dataclass
class _LastOutput:
    value: RequestOutput | None = None

    def __call__(self, out: RequestOutput) -> None:
        self.value = out


def _thinking_tokens(state: ServerState, run: ChatRun, out: RequestOutput | None) -> int:
    if out is None or not out.outputs or state.reasoning is None or run.reader is None:
        return 0
    return state.reasoning.thinking_tokens(out.outputs[0].token_ids, run.reader.start)


async def create_response(state: ServerState, req: ResponsesRequest, request: Request, tenant: str) -> Response:
    chat = chat_request(req)
    try:
        run = await start_chat(state, chat, tenant, id_prefix="resp")
    except APIError as exc:
        raise responses_error(exc) from None
    head = ResponseHead(run.request_id.replace("-", "_", 1), run.created, run.model, req)
    if req.stream:
        return ManagedStream(_stream(state, run, head), on_close=run.release)
    try:
        result = await chat_result(state, run, request)
    except ClientGone:
        return Response(status_code=499)
    choice = result.body["choices"][0]
    logprobs = (choice.get("logprobs") or {}).get("content")
    items = output_items(choice["message"], choice["finish_reason"], logprobs)
    u = result.body["usage"]
    usage = usage_of(u["prompt_tokens"], u["completion_tokens"], result.output.num_cached_tokens,
                     _thinking_tokens(state, run, result.output))
    return JSONResponse(head.body(status_of(choice["finish_reason"]), items, usage))


async def _stream(state: ServerState, run: ChatRun, head: ResponseHead) -> AsyncIterator[str]:
    events = ResponseEvents(head)
    last = _LastOutput()
    for event in events.start():
        yield sse_event(event)
    chunks = chat_chunks(state, run, observe=last)
    async with contextlib.aclosing(chunks):   # a client that leaves closes the engine's stream now, not at GC
        async for chunk in chunks:
            if "error" in chunk:
                for event in events.error(responses_error_body(chunk["error"])):
                    yield sse_event(event)
                return
            for event in events.chunk(chunk):
                yield sse_event(event)
    u = events.usage or {"prompt_tokens": 0, "completion_tokens": 0}
    out = last.value
    usage = usage_of(u["prompt_tokens"], u["completion_tokens"], out.num_cached_tokens if out else 0,
                     _thinking_tokens(state, run, out))
    for event in events.end(usage):
        yield sse_event(event)


def responses_error_body(error: dict[str, Any]) -> dict[str, Any]:
    renamed = responses_error(APIError(400, str(error.get("message", "")), error.get("param"), error.get("code")))
    return {"message": renamed.message, "param": renamed.param, "code": renamed.code}

