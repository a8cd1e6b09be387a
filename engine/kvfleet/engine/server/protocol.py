"""OpenAI-compatible request and response models.

Requests forbid unknown fields (a typo must not be silently ignored), coerce no types
and carry the value ranges, so a bad value is answered with 400 naming the field before
the engine sees it. The vLLM extras `top_k`, `min_p`, `ignore_eos`, `min_tokens`, ... are accepted
so vLLM clients and benchmark tools work unchanged.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

NonNegInt = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopField = Union[str, Annotated[list[str], Field(max_length=16)], None]
# What a JSON list of numbers holds: nothing a lone surrogate can hide in.
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def lone_surrogate_at(value: Any, where: str = "") -> str | None:
    """Where a string in `value` holds a lone UTF-16 surrogate ("\\ud800" is valid JSON but no Unicode
    text: tokenizers and UTF-8 encoders raise on it), as `field[0].sub`; None if nowhere.

    A walk with its own stack, not recursion: however deep `value` nests, this never meets Python's
    recursion limit."""
    pending: list[tuple[Any, str]] = [(value, where)]
    while pending:
        item, at = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return at or "body"
        elif isinstance(item, dict):
            children: list[tuple[Any, str]] = []
            for key, sub in item.items():
                children.append((key, at or "body"))
                children.append((sub, f"{at}.{key}" if at else str(key)))
            pending.extend(reversed(children))  # depth first, in document order, as reported before
        elif isinstance(item, list):
            if _SCALAR_TYPES.issuperset(map(type, item)):   # token ids, numbers: nothing inside (C speed)
                continue
            pending.extend(reversed([(sub, f"{at}[{i}]") for i, sub in enumerate(item)
                                     if isinstance(sub, (str, dict, list))]))
    return None


class StrictModel(BaseModel):
    # strict: a wrongly typed value is a 400, never coerced ("5" or 5.0 for an int, true for n,
    # "0.5" for a float); an int is still accepted where a float is expected (temperature=0).
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where:
            field = where.split(".")[0].split("[")[0]
            raise ValueError(f"{field}: invalid Unicode text at {where} (a lone UTF-16 surrogate)")
        return data


class OpenModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: a named schema (without one, any JSON object)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: plain text (the default), any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is required with type 'json_schema', and only then")
        return self


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extra: exactly one constraint (checked by the engine, which names it)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: StopField = None
    stop_token_ids: list[NonNegInt] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id (a JSON key, so a string) -> bias in [-100, 100], as the OpenAI API's
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: only these tokens may be sampled; these words may not be written
    allowed_token_ids: Annotated[list[NonNegInt], Field(min_length=1, max_length=2**20)] | None = None
    bad_words: Annotated[list[str], Field(max_length=1024)] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("structured_outputs: give it or a JSON response_format, not both")
        return self


class CompletionRequest(SamplingFields):
    # No fixed length cap on text: the server refuses what cannot fit its context before tokenizing it.
    prompt: Union[str, TokenIds,
                  Annotated[list[str], Field(min_length=1, max_length=64)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=64)]]
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]


class FunctionDefinition(StrictModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema (none: no parameters)
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: ToolName


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(StrictModel):
    name: str
    arguments: str   # JSON text, as the model wrote it


class ToolCallMessage(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# What the chat template's own call takes, or the template is given by the server: not a request's to set.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
    if reserved:
        raise ValueError(f"chat_template_kwargs.{reserved[0]}: is set by the server, not by a request")
    return value


# Extra variables for the chat template (vLLM's): `{"enable_thinking": false}` for Qwen3, ...
ChatTemplateKwargs = Annotated[dict[str, Any], Field(max_length=64), AfterValidator(_template_kwargs)]


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool's result: the call it answers
    reasoning: str | None = None                      # an assistant's earlier thinking (a reasoning parser's)

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("messages: only an assistant message has tool_calls")
        if self.reasoning is not None and self.role != "assistant":
            raise ValueError("messages: only an assistant message has reasoning")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("messages: a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def check_continue_final_message(messages: list[ChatMessage] | None, add_generation_prompt: bool,
                                 continue_final_message: bool) -> None:
    """vLLM's rule: continuing the conversation's last (assistant) message opens no new turn."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError("continue_final_message: cannot be true with add_generation_prompt true (set it false)")
    if messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's, to be continued")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the answer goes on from the last (assistant) message's text
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and (self.structured_outputs is not None
                       or (self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("tool_choice: a required or named tool call is a structured output already; "
                             "give it or response_format / structured_outputs, not both")
        check_continue_final_message(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        check_continue_final_message(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[NonNegInt]


# ---- responses (extra allowed: these document the shape, they do not police it) ----

class UsageInfo(OpenModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(OpenModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(OpenModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(OpenModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(OpenModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(OpenModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvfleet"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenModel):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenModel):
    prompt: str


class ErrorInfo(OpenModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
