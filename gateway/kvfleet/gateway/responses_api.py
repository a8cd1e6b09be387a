"""What the gateway reads of a Responses API request (`POST /v1/responses`; pure).

The conversation as turns, each a role and its text, in the order the engine renders them (it runs the request as a
chat: `instructions` a system message, then the input's items): the text behind the token estimate and the prefix
hashes. And, for a model served by vLLM, the part of a body the gateway checks (`vllm_view`): vLLM's Responses API
takes more than our engine's (images and files, built-in tools, stored responses); the replica checks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.engine.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    content_text,
)

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")
REASONING_PARTS = ("reasoning_text", "summary_text")
READ_FIELDS = ("model", "stream", "instructions", "max_output_tokens")   # and `input`, as text


@dataclass(frozen=True)
class Turn:
    role: str
    text: str


def turns(req: ResponsesRequest) -> list[Turn]:
    """The conversation in order: the instructions, then each input item as the chat turn the engine makes of it
    (a call is the assistant's, with its arguments; its output the tool's; reasoning the assistant's thinking, its
    content, else its summary, as the engine shows it)."""
    out = [Turn("system", req.instructions)] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*out, Turn("user", req.input)]
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append(Turn(item.role, content_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            out.append(Turn("assistant", item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(Turn("tool", content_text(item.output)))
        else:
            # parts joined as the engine joins them into the assistant's reasoning (server/responses_api.py)
            out.append(Turn("assistant", "\n".join(part.text for part in item.content or item.summary)))
    return out


def vllm_view(body: dict[str, Any]) -> dict[str, Any]:
    """The fields the gateway reads (model, streaming, the output limit, the instructions and the input's text) in
    our engine's shapes: a malformed one is still a 400 naming it, and nothing else is checked here."""
    view = {k: body[k] for k in READ_FIELDS if k in body}
    if "input" in body:
        view["input"] = _input_view(body["input"])
    return view


def _input_view(value: Any) -> Any:
    if not isinstance(value, list):
        return value   # a string, or the shapes' own 400
    items = [v for v in (_item_view(item) for item in value) if v is not None]
    return items or ""   # only items the replica reads (references, images): no text for the gateway


def _parts(value: Any, kinds: tuple[str, ...]) -> Any:
    """Text parts as `{type, text}` (images, files and audio are the replica's); a string as it is."""
    if not isinstance(value, list):
        return value
    return [{"type": p["type"], "text": p.get("text")} for p in value if isinstance(p, dict) and p.get("type") in kinds]


def _item_view(item: Any) -> Any:
    if not isinstance(item, dict):
        return item   # the shapes' own 400
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        return {"type": "message", "role": role if role in ROLES else "user",
                "content": _parts(item.get("content"), TEXT_PARTS)}
    if kind == "function_call":
        return {k: item[k] for k in ("type", "call_id", "name", "arguments") if k in item}
    if kind == "function_call_output":
        return {"type": kind, "call_id": item.get("call_id"), "output": _parts(item.get("output"), TEXT_PARTS)}
    if kind == "reasoning":
        view = {"type": kind, "summary": _parts(item.get("summary") or [], REASONING_PARTS)}
        if item.get("content") is not None:
            view["content"] = _parts(item["content"], REASONING_PARTS)
        return view
    return None   # an item type only vLLM serves (a reference, a built-in tool's call): the replica's to check
