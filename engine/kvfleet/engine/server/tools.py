"""Tool calling for chat completions (pure): OpenAI's `tools` and `tool_choice`, served as vLLM serves them.

- `none`: the model answers in text (the tools are still shown to the chat template, as vLLM does by default).
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that function's
  parameters schema (structured outputs) and returned as one tool call.
- `required`: constrained to a JSON list of `{"name", "parameters"}` objects, one schema per tool (at most one call
  unless `parallel_tool_calls`), returned as tool calls, `finish_reason` `tool_calls`.
- `auto` (the default when tools are given): the model decides; its text is parsed for calls in its chat template's
  format, which needs `--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags). Parsers: `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2.5, Qwen3 and Hermes templates)
  `llama3_json` (an answer that is `{"name": ..., "parameters": {...}}` objects, separated by `;`, as Llama
  3.1-3.3 templates ask for) and `pythonic` (an answer that is a Python list of calls with keyword arguments,
  `[get_weather(city="Paris"), now()]`, as Llama 3.2's and 4's pythonic templates ask for) and `mistral`
  (`[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` objects, Mistral's tokenizers before v11,
  or `[TOOL_CALLS]name[ARGS]{...}` per call, v11 on). With `mistral` an auto request's text keeps special tokens,
  `[TOOL_CALLS]` among them (vLLM does the same), and call ids are Mistral's: 9 letters and digits, which its chat
  templates require of the calls sent back to them.

Arguments are compact JSON (no whitespace between tokens, as OpenAI's): a model cannot spend its budget on
whitespace inside a call.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.server.protocol import ChatMessage, NamedToolChoice, Tool

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_TAG = "<|python_tag|>"   # Llama 3's tool-call start (a special token: gone when special tokens are skipped)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"   # Llama 4's, around pythonic calls
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"   # special tokens
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
_ID_CHARS = string.ascii_letters + string.digits
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer is read: plain text, one named call, required calls, or the model's choice."""

    kind: Literal["none", "named", "required", "auto"]
    name: str | None = None          # named: the function
    parser: str | None = None        # the server's --tool-call-parser (auto reads calls with it)
    parallel: bool = True            # auto: parallel_tool_calls (false: the model's first call only)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer must be decoded with special tokens: a format whose call tag is one."""
        return self.kind == "auto" and self.parser == "mistral"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                   # JSON text

    def to_openai(self, call_id: str, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": call_id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id(mode: ToolMode) -> str:
    """A call's id: vLLM's `chatcmpl-tool-<hex>`, or with the mistral parser 9 letters and digits (Mistral's
    templates refuse other ids in the conversation sent back)."""
    if mode.parser == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: list[ToolCall]


class ToolChoiceError(ValueError):
    """A request's tools and tool_choice cannot be served as given (a 400 naming `tool_choice`)."""


def tool_mode(tools: Sequence[Tool] | None, choice: str | NamedToolChoice | None, parser: str | None,
              parallel: bool = True) -> ToolMode:
    """The mode of a request (ToolChoiceError if it cannot be served)."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolChoiceError("tool_choice: needs tools")
        return ToolMode("none")
    if choice is None:
        choice = "auto"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise ToolChoiceError(f"tool_choice: function {name!r} is not among the tools")
        return ToolMode("named", name=name, parser=parser)
    if choice == "auto":
        if parser is None:
            raise ToolChoiceError('tool_choice: "auto" tool choice (the default with tools) requires '
                                  "--enable-auto-tool-choice and --tool-call-parser to be set; use \"required\", "
                                  "a named function or \"none\"")
        return ToolMode("auto", parser=parser, parallel=parallel)
    return ToolMode("required", parser=parser) if choice == "required" else ToolMode("none")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(tools: Sequence[Tool], mode: ToolMode, parallel: bool) -> StructuredOutputsParams | None:
    """The structured output a named or required tool choice generates under (None for none and auto)."""
    if mode.kind == "named":
        tool = next(t for t in tools if t.function.name == mode.name)
        return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)
    if mode.kind != "required":
        return None
    one_of = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
               "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if not parallel:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls, disable_any_whitespace=True)


def template_tools(tools: Sequence[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape, parameters defaulted)."""
    if not tools:
        return None
    return [{"type": "function", "function": {
        "name": t.function.name, "description": t.function.description or "", "parameters": _parameters(t)}}
        for t in tools]


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: text content; an assistant's tool calls with their arguments as
    objects (templates render them as JSON; OpenAI sends them as text) and its thinking; a tool result with its
    call's id."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning is not None:   # templates read it by either name (Qwen3's: reasoning_content)
            msg["reasoning"] = msg["reasoning_content"] = m.reasoning
        out.append(msg)
    return out


def _arguments_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text   # a template shows it as it came


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def finish_reason_with_calls(mode: ToolMode, finish_reason: str | None) -> str | None:
    """A choice's finish_reason once calls were read from it: a named function is what the request asked for, as
    OpenAI answers it ("stop" stays); else the model's calls ("tool_calls")."""
    return finish_reason if mode.kind == "named" else "tool_calls"


def parse_answer(text: str, mode: ToolMode, complete: bool) -> ParsedAnswer:
    """The answer's content and tool calls. A constrained answer cut off by max_tokens (not `complete`) is returned
    as content: its JSON is unfinished."""
    if mode.kind == "none":
        return ParsedAnswer(text, [])
    if mode.kind == "named":
        assert mode.name is not None
        return ParsedAnswer(None, [ToolCall(mode.name, text)]) if complete else ParsedAnswer(text, [])
    if mode.kind == "required":
        if not complete:
            return ParsedAnswer(text, [])
        return ParsedAnswer(None, [ToolCall(str(c["name"]), _compact(c["parameters"])) for c in json.loads(text)])
    answer = _format(mode).parse(text)
    # parallel_tool_calls false: one call at most (required is held to one by its schema, auto only here)
    return answer if mode.parallel else ParsedAnswer(answer.content, answer.tool_calls[:1])


def _call(obj: Any) -> ToolCall | None:
    """A `{"name": ..., "arguments" | "parameters": ...}` object as a call; None if it is none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else _compact(arguments))


def parse_hermes(text: str) -> ParsedAnswer:
    """Hermes-format calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number) and the text
    before the first as content. A block that is no such JSON object stays text: the answer is not lost."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedAnswer(text, [])
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = _call(json.loads(match.group(1)))
        except ValueError:
            return ParsedAnswer(text, [])
        if call is None:
            return ParsedAnswer(text, [])
        calls.append(call)
    content = text[:start].strip()
    return ParsedAnswer(content or None, calls)


def parse_llama3_json(text: str) -> ParsedAnswer:
    """Llama 3's calls: an answer that is (after an optional `<|python_tag|>`) one or more `{"name": ...,
    "parameters": {...}}` objects separated by `;`. Anything else, or anything that does not parse, is content."""
    body = text.strip()
    if body.startswith(LLAMA_TAG):
        body = body[len(LLAMA_TAG):].lstrip()
    if not body.startswith("{"):
        return ParsedAnswer(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return ParsedAnswer(text, [])
        call = _call(obj)
        if call is None:
            return ParsedAnswer(text, [])
        calls.append(call)
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return ParsedAnswer(None, calls)


_JSON_NAMES = {"true": True, "false": False, "null": None}   # what a model trained on JSON may write


def _literal(node: ast.expr) -> Any:
    """A call argument's value: a Python literal, JSON's true/false/null written as names included."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True) if k is not None}
    return ast.literal_eval(node)


def parse_pythonic(text: str) -> ParsedAnswer:
    """Pythonic calls: an answer that is (between an optional `<|python_start|>` and `<|python_end|>`, Llama 4's)
    a Python list of calls, `[name(arg=value, ...), ...]`, keyword arguments with literal values only. Anything
    else, or anything that does not parse, is content. Nothing is evaluated: the text is read as a syntax tree."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not body.startswith("["):
        return ParsedAnswer(text, [])
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return ParsedAnswer(text, [])
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return ParsedAnswer(text, [])
            calls.append(ToolCall(node.func.id, _compact({k.arg: _literal(k.value) for k in node.keywords})))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return ParsedAnswer(text, [])
    return ParsedAnswer(None, calls)


def _json_call_list(body: str) -> list[ToolCall] | None:
    """`[{"name": ..., "arguments": {...}}, ...]` and nothing after it as calls; None if it is not that."""
    if not body.startswith("["):
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        return None
    if body[end:].strip() or not isinstance(value, list) or not value:
        return None
    calls = [_call(obj) for obj in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _mistral_named_call(part: str) -> ToolCall | None:
    """v11 on: `name[ARGS]{...}` (`name[CALL_ID]id[ARGS]{...}` too; `name{...}` if [ARGS] was not kept)."""
    if MISTRAL_ARGS in part:
        name, args = part.split(MISTRAL_ARGS, 1)
        name = name.split(MISTRAL_CALL_ID, 1)[0]
    else:
        brace = part.find("{")
        name, args = (part[:brace], part[brace:]) if brace > 0 else (part, "")
    name, args = name.strip(), args.strip()
    if not _MISTRAL_NAME.fullmatch(name):
        return None
    try:
        value, end = json.JSONDecoder().raw_decode(args)
    except (ValueError, RecursionError):
        return None
    if args[end:].strip() or not isinstance(value, dict):
        return None
    return ToolCall(name, _compact(value))


def parse_mistral(text: str) -> ParsedAnswer:
    """Mistral's calls after `[TOOL_CALLS]`: a JSON list of `{"name", "arguments"}` objects (tokenizers before v11)
    or `name[ARGS]{...}`, one per tag (v11 on); the text before the first tag is content. Without the tag (its
    special token skipped), an answer that is such a JSON list. Anything that does not parse is content."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        listed = _json_call_list(text.strip())
        return ParsedAnswer(None, listed) if listed else ParsedAnswer(text, [])
    calls: list[ToolCall] = []
    for part in text[start:].split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):
            listed = _json_call_list(part)
            if listed is None:
                return ParsedAnswer(text, [])
            calls += listed
            continue
        call = _mistral_named_call(part)
        if call is None:
            return ParsedAnswer(text, [])
        calls.append(call)
    if not calls:
        return ParsedAnswer(text, [])
    return ParsedAnswer(text[:start].strip() or None, calls)


def _before_tag(tag: str) -> Callable[[str], str]:
    """For formats whose calls follow a tag anywhere in the answer: a stream sends the text before the tag, and
    holds back an end that may be the tag's start (a tag cut between two chunks)."""
    def streamable(text: str) -> str:
        start = text.find(tag)
        if start >= 0:
            return text[:start]
        for keep in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-keep:]):
                return text[:-keep]
        return text

    return streamable


def _mistral_streamable(text: str) -> str:
    """An answer that starts with `[` may be the tag or, the tag skipped, a call list: held back whole; else the
    text before the tag."""
    head = text.lstrip()
    if not head or head.startswith("["):
        return ""
    return _before_tag(MISTRAL_CALLS)(text)


def _text_before(tag: str) -> Callable[[str], str]:
    def before(text: str) -> str:
        start = text.find(tag)
        return text[:start] if start >= 0 else ""

    return before


def _whole_answer_streamable(opener: str, tag: str) -> Callable[[str], str]:
    """For formats whose calls are the whole answer (after an optional special `tag`): a stream holds back an
    answer that starts with `opener` or the tag, or may still become one, and sends any other as it grows."""
    def streamable(text: str) -> str:
        head = text.lstrip()
        if not head or head.startswith((opener, tag)) or tag.startswith(head):
            return ""   # a call (all of the answer is one) or not known yet
        return text

    return streamable


@dataclass(frozen=True)
class CallFormat:
    """A chat template's way of writing tool calls: how to read them, and what of a growing answer is surely
    content (a stream may send it)."""

    parse: Callable[[str], ParsedAnswer]
    streamable: Callable[[str], str]
    content_before_calls: Callable[[str], str]   # of an answer with calls: the content a stream sent


CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(parse_hermes, _before_tag(HERMES_OPEN), _text_before(HERMES_OPEN)),
    "llama3_json": CallFormat(parse_llama3_json, _whole_answer_streamable("{", LLAMA_TAG), lambda text: ""),
    "pythonic": CallFormat(parse_pythonic, _whole_answer_streamable("[", PYTHON_START), lambda text: ""),
    "mistral": CallFormat(parse_mistral, _mistral_streamable, _text_before(MISTRAL_CALLS)),
}
TOOL_CALL_PARSERS = tuple(CALL_FORMATS)


def _format(mode: ToolMode) -> CallFormat:
    assert mode.parser is not None
    return CALL_FORMATS[mode.parser]


def streamable_prefix(text: str, mode: ToolMode) -> str:
    """How much of a growing answer may be streamed as content now: all of it without tools; nothing of a named or
    required call (sent whole at the end); for auto, the text before anything that is or may become a call."""
    if mode.kind == "none":
        return text
    if mode.kind != "auto":
        return ""
    return _format(mode).streamable(text)


def streamed_content(text: str, mode: ToolMode, answer: ParsedAnswer) -> str:
    """All of the answer a stream sends as content (the non-streamed answer's content, unstripped): the text,
    or the part before its calls."""
    if not answer.tool_calls:
        return text
    return _format(mode).content_before_calls(text) if mode.kind == "auto" else ""
