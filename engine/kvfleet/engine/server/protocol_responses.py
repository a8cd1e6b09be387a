"""The request of OpenAI's Responses API (`POST /v1/responses`), as this server takes it.

Stateless, as vLLM serves it by default: a request carries its whole conversation in `input` (messages, earlier
function calls and their outputs, earlier reasoning), nothing is stored (`store` is answered false), and what needs
stored state (`previous_response_id`, `conversation`, `background`) is a 400 naming the field. Text only; function
tools only. Unknown fields are a 400, as on every other endpoint; a few of OpenAI's hints that change nothing here
(`prompt_cache_key`, `safety_identifier`, `service_tier`, `text.verbosity`, `reasoning.summary`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from kvfleet.engine.server.protocol import NonNegInt, Penalty, Seed, StopField, StrictModel, ToolName

# What `include` may ask for: only the answer's logprobs are something this server has.
INCLUDABLE = ("message.output_text.logprobs",)


class TextContent(StrictModel):
    """A text part of a message: the client's (`input_text`) or an earlier answer's (`output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None   # an earlier answer's, sent back as they came
    logprobs: list[Any] | None = None


def content_text(content: "str | list[TextContent]") -> str:
    """A message's or a function output's text: a string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, Annotated[list[TextContent], Field(max_length=1024)]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    """An earlier answer's call, sent back before its output."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Union[str, Annotated[list[TextContent], Field(max_length=1024)]]
    id: str | None = None
    status: str | None = None


class ReasoningPart(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """An earlier answer's thinking: shown to the chat template with the assistant turn that follows it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None   # nothing here encrypts: never sent by this server
    status: str | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")   # a message may leave its type out
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")],
    Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Annotated[ReasoningItem, Tag("reasoning")],
], Discriminator(_item_type, custom_error_type="invalid_item_type",
                 custom_error_message="an input item's type is one of message, function_call, function_call_output "
                                      "and reasoning (this server keeps no items to reference)")]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictModel):
    type: Literal["function"]
    name: ToolName


class FormatText(StrictModel):
    type: Literal["text"]


class FormatJsonObject(StrictModel):
    type: Literal["json_object"]


class FormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[FormatText, FormatJsonObject, FormatJsonSchema], Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # a hint to OpenAI's models: nothing to do here


class ReasoningConfig(StrictModel):
    effort: Literal["minimal", "low", "medium", "high"] | None = None   # the chat template's `reasoning_effort`
    summary: Literal["auto", "concise", "detailed"] | None = None       # no summaries are written here
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: Union[str, Annotated[list[InputItem], Field(min_length=1, max_length=1024)]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[FunctionTool], Field(min_length=0, max_length=128)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    store: bool = True                 # accepted; nothing is stored (the response says store: false)
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None     # prefix caching here needs no key
    safety_identifier: str | None = None
    # vLLM's sampling extras, as on the other endpoints
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    stop: StopField = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _input_items_served_here(cls, data: Any) -> Any:
        """What this server does not take in `input` (other item types, images, files), said plainly before the
        union's own errors would list every shape it tried."""
        items = data.get("input") if isinstance(data, dict) else None
        if not isinstance(items, list):
            return data
        if not items:
            raise ValueError("input: give the conversation: a string, or a list of at least one item")
        for i, item in enumerate(items):
            kind = _item_type(item)
            if kind not in ITEM_TYPES:
                raise ValueError(f"input: item {i} has type {kind!r}; an input item is one of "
                                 f"{', '.join(ITEM_TYPES)} (this server keeps no items to reference)")
            parts = item.get("content") if kind == "message" and isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type not in ("input_text", "output_text"):
                    raise ValueError(f"input: item {i}, content part {j} has type {part_type!r}; this server "
                                     "takes text only (input_text, output_text)")
        return data

    @model_validator(mode="after")
    def _served_here(self) -> "ResponsesRequest":
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server stores no responses; send the whole conversation "
                             "in input (earlier output items included)")
        if self.conversation is not None:
            raise ValueError("conversation: this server stores no conversations; send the whole conversation in "
                             "input")
        if self.background:
            raise ValueError("background: this server answers in the foreground only")
        if self.truncation == "auto":
            raise ValueError("truncation: only \"disabled\" is served (a conversation longer than the model's "
                             "context is a 400)")
        for i, name in enumerate(self.include or []):
            if name not in INCLUDABLE:
                raise ValueError(f"include: {name!r} (include[{i}]) is not served here (only "
                                 f"{', '.join(repr(x) for x in INCLUDABLE)})")
        if isinstance(self.tool_choice, FunctionToolChoice) and self.tool_choice.name not in \
                {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice: function {self.tool_choice.name!r} is not among the tools")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or [])
