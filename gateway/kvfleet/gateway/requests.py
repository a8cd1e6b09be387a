"""A request body, checked with the engine's own shapes before any upstream call (pure).

The gateway validates with the engine's pydantic models (`kvfleet.engine.server.protocol`, and
`protocol_responses` for OpenAI's Responses API) and
answers with its error shapes (`error_shapes`), so a client sees the same 400 naming the field
whether the gateway or an engine refused it. What needs the model (prompt length against the
context, token ids against the vocabulary) is the engine's to check; its 400 passes through.
A model served by vLLM takes more than our engine does: only what the gateway reads is checked
(`vllm_view`), and the replica gets the client's body as it came.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from pydantic import ValidationError

from kvfleet.engine.server.error_shapes import APIError, describe_validation_errors
from kvfleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from kvfleet.engine.server.protocol_responses import ResponsesRequest
from kvfleet.gateway import responses_api

Generation = Union[ChatCompletionRequest, CompletionRequest, ResponsesRequest]
Parsed = Union[ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
RESPONSES = "/v1/responses"
ROUTES: dict[str, type[Parsed]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    RESPONSES: ResponsesRequest,   # OpenAI's Responses API: one answer, its stream typed events with usage at the end
    # vLLM's (unversioned) routes: the model's own tokenizer, on one of its replicas; nothing is generated
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


@dataclass(frozen=True)
class ClientRequest:
    path: str
    body: dict[str, Any]  # as the client sent it
    parsed: Parsed
    model: str

    @property
    def generation(self) -> Generation | None:
        """The chat, completion or Responses request; None for /tokenize and /detokenize."""
        parsed = self.parsed
        return parsed if isinstance(parsed, (ChatCompletionRequest, CompletionRequest, ResponsesRequest)) else None

    @property
    def responses(self) -> ResponsesRequest | None:
        """The Responses API request (its stream is typed events ending in the response, no `[DONE]`), else None."""
        return self.parsed if isinstance(self.parsed, ResponsesRequest) else None

    @property
    def stream(self) -> bool:
        gen = self.generation
        return gen is not None and gen.stream

    @property
    def wants_usage(self) -> bool:
        """Whether the client gets a stream's usage: asked for (`stream_options`), or always (a Responses stream's
        last event carries it: there is nothing to ask for, nor to drop)."""
        gen = self.generation
        if isinstance(gen, ResponsesRequest):
            return True
        opts = gen.stream_options if gen is not None else None
        return bool(opts and opts.include_usage)


def parse_body(raw: bytes) -> Any:
    """The JSON of a request body, or APIError(400)."""
    if not raw.strip():
        raise APIError(400, "Request body is required (a JSON object)", code="missing_body")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "Malformed request body (not UTF-8): send UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"Malformed JSON body: {exc.msg} at line {exc.lineno} column {exc.colno}",
                       code="invalid_json") from None


def requested_model(body: Any) -> str | None:
    """The body's `model`, when it is a name (what the model is decides how the body is checked)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


CHAT_ROLES = ("system", "developer", "user", "assistant")


def vllm_view(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What of a body for a vLLM replica the gateway reads, in the engine's shapes (pure): the fields those shapes
    know, messages as role and text. vLLM serves more than our engine (tools, JSON mode and schemas, images, tool
    messages, its own extras): the replica gets the client's body whole and checks it itself; the gateway needs only
    the model, streaming, sampling counts and the text for its estimates and prefix routing."""
    if path == RESPONSES:
        return responses_api.vllm_view(body)
    # vLLM's versions of these have more members than our engine's: the replica checks them.
    known = set(ROUTES[path].model_fields) - {"response_format", "structured_outputs", "tools", "tool_choice",
                                              "parallel_tool_calls", "chat_template_kwargs"}
    view = {k: v for k, v in body.items() if k in known}
    if isinstance(view.get("messages"), list):
        view["messages"] = [_message_view(m) for m in view["messages"]]
    return view


def _message_view(message: Any) -> Any:
    if not isinstance(message, dict):
        return message   # the shapes' own 400
    role = message.get("role")
    content = message.get("content")
    if isinstance(content, list):   # text parts kept (images and audio are the replica's)
        content = [p for p in content if isinstance(p, dict) and p.get("type") == "text"] or None
    view: dict[str, Any] = {"role": role if role in CHAT_ROLES else "user", "content": content}
    if isinstance(message.get("name"), str):
        view["name"] = message["name"]
    return view


def check_request(path: str, body: Any, vllm: bool = False) -> ClientRequest:
    """The parsed body of a POST to `path` (one of ROUTES), or APIError(400). `vllm`: the model's replicas run vLLM,
    so only what `vllm_view` keeps is checked (the replica checks the rest)."""
    checked = vllm_view(path, body) if vllm and isinstance(body, dict) else body
    try:
        parsed = ROUTES[path].model_validate(checked)
    except ValidationError as exc:
        message, param, code = describe_validation_errors(exc.errors())
        raise APIError(400, message, param, code) from None
    if not parsed.model:
        raise APIError(400, "Missing required field 'model' (the gateway serves several models: "
                            "GET /v1/models lists yours)", "model", "missing_field")
    return ClientRequest(path, body, parsed, parsed.model)


def parse_request(path: str, raw: bytes, vllm: bool = False) -> ClientRequest:
    """The body of a POST to `path` (one of ROUTES), or APIError(400)."""
    return check_request(path, parse_body(raw), vllm)


CHARS_PER_TOKEN = 4  # a rough, tokenizer-free estimate for text
DEFAULT_COMPLETION_ESTIMATE = 256  # no max_tokens (chat) or max_output_tokens: what it is expected to generate at most
MAX_COMPLETION_ESTIMATE = 4096


def token_estimate(req: ClientRequest) -> tuple[float, float]:
    """(prompt, completion) tokens a request is expected to use, before the engine says (fair queuing's charge;
    corrected by the usage when it ends). Text counts a token per 4 characters, a chat's (or a Responses
    request's) tools by their JSON; token ids count as they are. (De)tokenizing runs no model: it costs nothing."""
    parsed = req.generation
    if parsed is None:
        return 0.0, 0.0
    if isinstance(parsed, ResponsesRequest):   # one answer (no `n`); a turn counts like a chat message
        turns = responses_api.turns(parsed)
        prompt = sum(len(t.text) for t in turns) / CHARS_PER_TOKEN + 4 * len(turns) + _tools_estimate(req)
        return prompt, float(min(parsed.max_output_tokens or DEFAULT_COMPLETION_ESTIMATE, MAX_COMPLETION_ESTIMATE))
    n = max(1, parsed.n)
    if isinstance(parsed, ChatCompletionRequest):
        prompt = sum(len(m.text()) for m in parsed.messages) / CHARS_PER_TOKEN + 4 * len(parsed.messages)
        prompt += _tools_estimate(req)
        limit = parsed.max_completion_tokens or parsed.max_tokens
    else:
        prompts = parsed.prompt if isinstance(parsed.prompt, list) and parsed.prompt and not isinstance(
            parsed.prompt[0], int) else [parsed.prompt]
        prompt = sum(len(p) / CHARS_PER_TOKEN if isinstance(p, str) else len(p) for p in prompts)
        n *= len(prompts)
        limit = parsed.max_tokens
    completion = min(limit or DEFAULT_COMPLETION_ESTIMATE, MAX_COMPLETION_ESTIMATE)
    return prompt, float(completion * n)


def _tools_estimate(req: ClientRequest) -> float:
    """The tools' tokens: the chat template shows them to the model (as sent: vLLM's may be wider)."""
    tools = req.body.get("tools")
    return len(json.dumps(tools)) / CHARS_PER_TOKEN if isinstance(tools, list) and tools else 0.0


def upstream_body(req: ClientRequest, served_name: str, raw: bytes) -> bytes:
    """What the replica gets: the client's body, with the engine's model name, and for a chat or completion stream
    the final usage chunk asked for (the token counts behind chargeback; dropped again if the client did not ask).
    A Responses body has no `stream_options` (the engine would refuse one): its stream ends with the usage anyway."""
    rename = req.model != served_name
    add_usage = req.stream and not req.wants_usage
    if not rename and not add_usage:
        return raw
    body = dict(req.body)
    body["model"] = served_name
    if add_usage:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()
