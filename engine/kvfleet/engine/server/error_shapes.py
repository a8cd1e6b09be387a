"""OpenAI-style error shapes, free of FastAPI: `{"error": {"message", "type", "param", "code"}}`.

Pure functions shared by the engine's server (`errors.py` installs them as FastAPI handlers) and the
gateway, which refuses bad input with the same shapes before any upstream call.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",  # the gateway: a replica failed
    503: "service_unavailable",
    504: "server_error",
}


class APIError(Exception):
    """An error the server answers on purpose."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _loc_text(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried in `loc` ('str', 'list[constrained-int]', ...)."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


def _field_loc(error: Mapping[str, Any]) -> list[Any]:
    return [p for p in error.get("loc", ()) if p != "body"]


def _union_message(errors: Sequence[Mapping[str, Any]], prefix: list[Any]) -> str:
    """One line for a value that matched no member of a union: each member and why it failed."""
    reasons: dict[str, str] = {}
    for error in errors:
        loc = _field_loc(error)
        if len(loc) <= len(prefix) or loc[:len(prefix)] != prefix or not _is_union_tag(loc[len(prefix)]):
            continue
        tag = str(loc[len(prefix)]).replace("constrained-", "")
        if tag not in reasons:
            where = _loc_text(["x", *loc[len(prefix) + 1:]])[1:]
            reasons[tag] = (f"at {where}: " if where else "") + str(error.get("msg", "invalid"))
    listed = "; ".join(f"as {tag}, {why}" for tag, why in reasons.items())
    return f"Invalid value for '{_loc_text(prefix)}': it matches none of the accepted types ({listed})"


# Request fields of the OpenAI API (and vLLM's older structured-output extras, which vLLM has replaced by
# `structured_outputs`) this server knows and does not implement: refused by name as unsupported, not as a typo (a
# client that sends one asks for behaviour it would not get). JSON modes are served: `response_format`, and vLLM's
# `structured_outputs`.
UNSUPPORTED_FIELDS = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "audio",
    "modalities", "prediction", "web_search_options", "reasoning_effort", "best_of", "suffix",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic/FastAPI errors: the first error names the field."""
    if not errors:
        return "Invalid request", None, "invalid_request"
    first = errors[0]
    loc = _field_loc(first)
    tag_at = next((i for i, part in enumerate(loc) if i > 0 and _is_union_tag(part)), None)
    if tag_at is not None:
        return _union_message(errors, loc[:tag_at]), str(loc[0]), "invalid_value"
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return "Malformed JSON body: " + str(first.get("ctx", {}).get("error", first.get("msg", ""))), None, \
            "invalid_json"
    if not loc and kind == "missing":
        return "Request body is required (a JSON object)", None, "missing_body"
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return "The request body must be a JSON object (Content-Type: application/json)", None, "invalid_body"
    msg = str(first.get("msg", "invalid value"))
    if not loc and kind == "value_error":
        # model validators write "field: reason"; lift the field into `param`.
        text = msg.removeprefix("Value error, ")
        field, sep, reason = text.partition(": ")
        if sep and field.isidentifier():
            return f"{field}: {reason}", field, "invalid_value"
        return text, None, "invalid_value"
    param = str(loc[0]) if loc else None
    where = _loc_text(loc) or "body"
    if kind == "extra_forbidden":
        if len(loc) == 1 and param in UNSUPPORTED_FIELDS:
            return f"'{where}' is not supported by this server", param, "unsupported_field"
        return f"Unknown field '{where}'", param, "unknown_field"
    if kind == "missing":
        return f"Missing required field '{where}'", param, "missing_field"
    return f"Invalid value for '{where}': {msg}", param, "invalid_value"


def value_error_param(message: str, fields: Sequence[str]) -> str | None:
    """The request field an engine `ValueError` message names, if any (it starts with or quotes it)."""
    head = message.split(":", 1)[0].strip().strip("'\"`")
    if head in fields:
        return head
    for name in fields:
        if f"'{name}'" in message or f"`{name}`" in message or message.startswith(name + " "):
            return name
    return None
