"""Tool calling's pure parts (kvfleet.engine.server.tools): which mode a request is served in, the constraint of a
named or required choice, reading calls back, the Hermes parser on what Qwen-family models write, and how much of
a growing answer a stream may send before a call could start."""

from __future__ import annotations

import json

import pytest

from kvfleet.engine.server.args import SERVE_FLAGS
from kvfleet.engine.server.protocol import ChatMessage, NamedToolChoice, Tool
from kvfleet.engine.server.tools import (
    TOOL_CALL_PARSERS,
    ToolChoiceError,
    ToolMode,
    parse_answer,
    parse_hermes,
    parse_llama3_json,
    parse_pythonic,
    streamable_prefix,
    streamed_content,
    template_messages,
    template_tools,
    tool_constraint,
    tool_mode,
)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "now"}})
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}})


def test_modes_and_what_cannot_be_served() -> None:
    assert tool_mode(None, None, None) == ToolMode("none")
    assert tool_mode([WEATHER], "none", None) == ToolMode("none")
    assert tool_mode([WEATHER, CLOCK], NAMED, None) == ToolMode("named", name="now")
    assert tool_mode([WEATHER], "required", None) == ToolMode("required")
    assert tool_mode([WEATHER], None, "hermes") == ToolMode("auto", parser="hermes")   # auto: the default
    for tools, choice, says in (([WEATHER], None, "--enable-auto-tool-choice"), ([WEATHER], "auto", "auto"),
                                ([WEATHER], NAMED, "'now' is not among the tools"), (None, "required", "needs tools")):
        with pytest.raises(ToolChoiceError, match=says):
            tool_mode(tools, choice, None)


def test_constraints_of_named_and_required_choices() -> None:
    named = tool_constraint([WEATHER, CLOCK], ToolMode("named", name="get_weather"), parallel=True)
    assert named is not None and named.json == WEATHER.function.parameters and named.disable_any_whitespace
    required = tool_constraint([WEATHER, CLOCK], ToolMode("required"), parallel=False)
    assert required is not None and isinstance(required.json, dict)
    assert required.json["minItems"] == 1 and required.json["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in required.json["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert required.json["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    parallel = tool_constraint([WEATHER], ToolMode("required"), parallel=True)
    assert parallel is not None and isinstance(parallel.json, dict) and "maxItems" not in parallel.json
    assert tool_constraint([WEATHER], ToolMode("none"), True) is None
    assert tool_constraint([WEATHER], ToolMode("auto", parser="hermes"), True) is None


def test_answers_read_back() -> None:
    named = parse_answer('{"city":"Oslo"}', ToolMode("named", name="get_weather"), complete=True)
    assert named.content is None and [(c.name, c.arguments) for c in named.tool_calls] == [
        ("get_weather", '{"city":"Oslo"}')]
    required = parse_answer('[{"name":"get_weather","parameters":{"city":"Åre"}},{"name":"now","parameters":{}}]',
                            ToolMode("required"), complete=True)
    assert [(c.name, json.loads(c.arguments)) for c in required.tool_calls] == [
        ("get_weather", {"city": "Åre"}), ("now", {})]
    cut = parse_answer('[{"name":"get_w', ToolMode("required"), complete=False)   # max_tokens: no call, the text
    assert cut.content == '[{"name":"get_w' and cut.tool_calls == []
    call = named.tool_calls[0].to_openai(0)
    assert call["index"] == 0 and call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"


def test_hermes_parser_on_what_qwen_models_write() -> None:
    one = parse_hermes('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>')
    assert one.content == "I will look." and [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    two_text = ('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
                '"arguments": {"city": "Rome"}}</tool_call>')
    two = parse_hermes(two_text)
    assert two.content is None and [c.name for c in two.tool_calls] == ["now", "get_weather"]
    single = ToolMode("auto", parser="hermes", parallel=False)   # parallel_tool_calls false: the first call only
    assert [c.name for c in parse_answer(two_text, single, True).tool_calls] == ["now"]
    assert tool_mode([WEATHER], None, "hermes", parallel=False) == single
    unclosed = parse_hermes('<tool_call>{"name": "now", "arguments": {}}')   # stopped before its closing tag
    assert [c.name for c in unclosed.tool_calls] == ["now"]
    for text in ("no calls here", '<tool_call>{"name": broken</tool_call>', "<tool_call>[1, 2]</tool_call>"):
        assert parse_hermes(text).tool_calls == [] and parse_hermes(text).content == text   # kept as text


def test_a_stream_holds_back_what_may_become_a_call() -> None:
    auto = ToolMode("auto", parser="hermes")
    assert streamable_prefix("Hello <tool", auto) == "Hello "
    assert streamable_prefix("Hello <b>", auto) == "Hello <b>"
    assert streamable_prefix('Hi<tool_call>{"name"', auto) == "Hi"
    assert streamable_prefix("plain", ToolMode("none")) == "plain"
    assert streamable_prefix('{"city"', ToolMode("named", name="x")) == ""
    text = 'Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    assert streamed_content(text, auto, parse_answer(text, auto, True)) == "Sure."
    assert streamed_content("just text", auto, parse_answer("just text", auto, True)) == "just text"


def test_templates_get_tools_and_earlier_calls_as_objects() -> None:
    assert template_tools([CLOCK]) == [{"type": "function", "function": {
        "name": "now", "description": "", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"})]
    rendered = template_messages(msgs)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[1]["content"] == "" and rendered[2] == {"role": "tool", "content": "rain", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match="needs tool_call_id"):
        ChatMessage.model_validate({"role": "tool", "content": "rain"})
    with pytest.raises(ValueError, match="only an assistant message has tool_calls"):
        ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": []})


def test_llama3_json_parser_on_what_llama_models_write() -> None:
    one = parse_llama3_json('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert one.content is None and [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    two = parse_llama3_json('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "get_weather", '
                            '"arguments": {"city": "Rome"}}')
    assert [c.name for c in two.tool_calls] == ["now", "get_weather"]
    for text in ("The weather is fine.", '{"name": "now", "parameters": {}} and more', '{"city": "x"}',
                 '{"name": "now", "parameters": '):
        assert parse_llama3_json(text).tool_calls == [] and parse_llama3_json(text).content == text
    llama = ToolMode("auto", parser="llama3_json")
    assert streamable_prefix("  ", llama) == "" and streamable_prefix('{"na', llama) == ""
    assert streamable_prefix("<|python", llama) == "" and streamable_prefix("It is", llama) == "It is"
    text = '{"name": "now", "parameters": {}}'
    assert streamed_content(text, llama, parse_answer(text, llama, True)) == ""


def test_pythonic_parser_on_what_llama_models_write() -> None:
    """Llama 3.2's and 4's pythonic calls: keyword arguments with literals (JSON's true/false/null too) become
    JSON arguments; anything that is not a list of such calls stays content, and nothing is evaluated."""
    one = parse_pythonic('[get_weather(city="Paris", days=3, hourly=True, units=None, tags=["a", 1.5], '
                         "where={'lat': 48.8, 'ok': true})]")
    assert one.content is None and [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "hourly": True, "units": None, "tags": ["a", 1.5],
                         "where": {"lat": 48.8, "ok": True}})]
    two = parse_pythonic("<|python_start|>[now(), get_weather(city='Rome')]<|python_end|>")
    assert [c.name for c in two.tool_calls] == ["now", "get_weather"] and two.tool_calls[0].arguments == "{}"
    for text in ("The weather is fine.", "[1, 2]", "[]", "[now(1)]", "[now(**kw)]", "[os.system('x')]",
                 "[now(x=__import__('os'))]", "[now(x={1, 2})]", "[now(x=b'1')]", "[now(x=", "[now()] and more",
                 "[" * 1000):
        assert parse_pythonic(text).tool_calls == [] and parse_pythonic(text).content == text
    pythonic = ToolMode("auto", parser="pythonic")
    assert streamable_prefix(" ", pythonic) == "" and streamable_prefix("[get_", pythonic) == ""
    assert streamable_prefix("<|python", pythonic) == "" and streamable_prefix("It is", pythonic) == "It is"
    text = "[now()]"
    assert streamed_content(text, pythonic, parse_answer(text, pythonic, True)) == ""


def test_the_servers_parser_choices_are_the_formats_read() -> None:
    (flag,) = [f for f in SERVE_FLAGS if f.name == "--tool-call-parser"]
    assert flag.choices == TOOL_CALL_PARSERS
