"""OpenAI's Responses API (`POST /v1/responses`) through the real `openai` client against the real `kvfleet serve`
process (tiny random model): each answer is the chat endpoint's for the same conversation, told as output items
(text, function calls, JSON under a schema, logprobs), streamed as OpenAI's numbered events that add up to the same
response; what this stateless server does not serve, and bad values, are 400s naming the Responses field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from server_proc import ALPHA, Server

WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]},
                                                                "rain": {"type": "boolean"}},
                               "required": ["unit", "rain"], "additionalProperties": False}}
CHAT_WEATHER: Any = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]}},
          "required": ["sky"], "additionalProperties": False}


def test_a_response_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI) -> None:
    """`instructions` + string input are a system and a user message: same prompt tokens, same greedy text, the
    usage in Responses' names; max_output_tokens reached is an incomplete response, as OpenAI says it."""
    got = client.responses.create(model="tiny", instructions="be brief", input="hello there", max_output_tokens=6,
                                  temperature=0)
    chat = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert got.object == "response" and got.id.startswith("resp_") and got.store is False
    assert got.output_text == chat.choices[0].message.content
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert got.usage is not None and chat.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert got.instructions == "be brief" and got.max_output_tokens == 6 and got.temperature == 0


def test_input_items_are_the_chat_messages_they_stand_for(client: openai.OpenAI) -> None:
    """Messages with text parts, an earlier answer's function call and its output: the chat endpoint given the
    equivalent messages (tool calls, a tool message) sees the same prompt and answers the same."""
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather"}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit":"C"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "developer", "content": "answer now"}]
    messages: Any = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit":"C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "developer", "content": "answer now"}]
    got = client.responses.create(model="tiny", input=items, max_output_tokens=5, temperature=0,
                                  tools=[WEATHER], tool_choice="none")
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          tools=[CHAT_WEATHER], tool_choice="none")
    assert got.usage is not None and chat.usage is not None
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.output_text == chat.choices[0].message.content


def test_a_stream_is_numbered_events_that_add_up_to_the_response(client: openai.OpenAI, api_server: Server) -> None:
    """The text deltas join to the non-streamed text; events are numbered from 0 without a gap, every `event:`
    line names its data's type, and the last event is the whole response with its usage (no [DONE])."""
    whole = client.responses.create(model="tiny", input="stream me", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model="tiny", input="stream me", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens == 8
    raw = httpx.post(api_server.url + "/v1/responses", headers={"Authorization": f"Bearer {ALPHA}"}, timeout=60,
                     json={"model": "tiny", "input": "stream me", "max_output_tokens": 3, "stream": True})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.text.split("\n\n") if b.strip()]
    assert "[DONE]" not in raw.text and blocks
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]


def test_function_tools_answer_function_call_items(client: openai.OpenAI) -> None:
    """A named function: one function_call item whose arguments hold to the schema, streamed as argument events
    with the same arguments; `required` gives at least one call."""
    got = client.responses.create(model="tiny", input="weather?", max_output_tokens=40, temperature=0,
                                  tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    (call,) = got.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert set(args) == {"unit", "rain"} and args["unit"] in ("C", "F") and isinstance(args["rain"], bool)
    events = list(client.responses.create(model="tiny", input="weather?", max_output_tokens=40, temperature=0,
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    required = client.responses.create(model="tiny", input="weather?", max_output_tokens=60, temperature=0,
                                       tools=[WEATHER], tool_choice="required")
    assert required.output and all(item.type == "function_call" for item in required.output)


def test_a_conversation_goes_on_with_the_output_items_sent_back(client: openai.OpenAI) -> None:
    """The way agents keep a stateless conversation: the response's own output items (a function call) sent back
    as input with the call's output, then the next answer's message, then a new user turn: each turn renders (a
    longer prompt every time) and is answered."""
    history: list[Any] = [{"role": "user", "content": "weather?"}]
    first = client.responses.create(model="tiny", input=history, max_output_tokens=30, temperature=0,
                                    tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    assert call.type == "function_call"
    history += [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    second = client.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0,
                                     tools=[WEATHER], tool_choice="none")
    assert [item.type for item in second.output] == ["message"]
    history += [*second.output, {"role": "user", "content": "thanks"}]
    third = client.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0)
    assert first.usage and second.usage and third.usage
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens


def test_text_format_and_logprobs(client: openai.OpenAI) -> None:
    """`text.format` json_schema is chat's response_format: a document of the schema; `include` of the text's
    logprobs gives one entry per output token, each with its top alternatives, equal to chat's."""
    got = client.responses.create(model="tiny", input="sky?", max_output_tokens=30, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "sky", "schema": SCHEMA,
                                                   "strict": True}})
    chat = client.chat.completions.create(   # (a random model may write JSON's whitespace until max_tokens)
        model="tiny", messages=[{"role": "user", "content": "sky?"}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "sky", "schema": SCHEMA, "strict": True}})
    assert got.output_text == chat.choices[0].message.content and got.output_text.startswith("{")
    assert got.text is not None and got.text.format is not None and got.text.format.type == "json_schema"
    lp = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                 include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    part = lp.output[0].content[0]   # type: ignore[union-attr]
    want = (chat.choices[0].logprobs and chat.choices[0].logprobs.content) or []
    assert part.type == "output_text" and len(part.logprobs or []) == len(want) == 4
    assert [t.token for t in part.logprobs or []] == [t.token for t in want]
    assert [len(t.top_logprobs) for t in part.logprobs or []] == [2] * 4
    streamed = list(client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0,
                                            top_logprobs=2, include=["message.output_text.logprobs"], stream=True))
    tokens = [t["token"] for e in streamed if e.type == "response.output_text.delta" for t in e.to_dict()["logprobs"]]
    assert tokens == [t.token for t in want]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "x", "background": True}, "background", "foreground"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "not served"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "n": 2}, "n", "Unknown field"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "keeps no items"),
    ({"input": [{"type": "web_search_call"}]}, "input", "input item"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not among the tools"),
    ({"input": "x", "tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"input": "x " * 400}, "input", "input"),
    ({"input": []}, "input", "at least one item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}}, "text",
     "text.format.schema"),
])
def test_what_is_not_served_is_a_400_naming_the_responses_field(client: openai.OpenAI, body: dict[str, Any],
                                                               param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": "tiny", **body}, cast_to=dict)
    error = info.value.body
    assert isinstance(error, dict) and info.value.param == param and says in error["message"], error


def test_a_tenant_key_is_needed(api_server: Server) -> None:
    resp = httpx.post(api_server.url + "/v1/responses", json={"model": "tiny", "input": "x"}, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
