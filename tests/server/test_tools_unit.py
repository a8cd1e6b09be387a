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
    new_call_id,
    parse_answer,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
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
    assert tool_mode([WEATHER], "required", "mistral") == ToolMode("required", parser="mistral")
    assert ToolMode("auto", parser="mistral").keeps_special_tokens
    assert not ToolMode("required", parser="mistral").keeps_special_tokens
    assert not ToolMode("auto", parser="hermes").keeps_special_tokens
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
    call = named.tool_calls[0].to_openai(new_call_id(ToolMode("named", name="now", parser="hermes")), 0)
    assert call["index"] == 0 and call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    ids = {new_call_id(ToolMode("required", parser="mistral")) for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)   # Mistral's rule


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


def test_mistral_parser_on_what_mistral_models_write() -> None:
    """Mistral's formats: a JSON list after [TOOL_CALLS] (before v11), `name[ARGS]{...}` per tag (v11 on, a call id
    too in later ones), a list whose tag was skipped as a special token; content before the tag is content, and
    anything that does not parse whole stays text."""
    old = parse_mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                        '{"name": "now", "arguments": {}}]')
    assert old.content is None and [(c.name, json.loads(c.arguments)) for c in old.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    new = parse_mistral('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}')
    assert new.content == "Checking." and [(c.name, c.arguments) for c in new.tool_calls] == [
        ("get_weather", '{"city":"Rome"}'), ("now", "{}")]
    with_id = parse_mistral('[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}')
    assert [(c.name, c.arguments) for c in with_id.tool_calls] == [("now", '{"tz":"UTC"}')]
    skipped = parse_mistral(' [{"name": "now", "arguments": {}}]')
    assert skipped.content is None and [c.name for c in skipped.tool_calls] == ["now"]
    for text in ("The weather is fine.", "[1, 2]", "[]", "[TOOL_CALLS]", '[TOOL_CALLS] [{"name": "now"',
                 '[TOOL_CALLS]now[ARGS]{"a": 1} and more', '[TOOL_CALLS]not a name[ARGS]{}',
                 '[TOOL_CALLS]now[ARGS][1]', '[{"name": "now", "arguments": {}}] and more', "[" * 5000):
        assert parse_mistral(text).tool_calls == [] and parse_mistral(text).content == text, text
    mistral = ToolMode("auto", parser="mistral")
    assert streamable_prefix(" ", mistral) == "" and streamable_prefix("[TOOL", mistral) == ""
    assert streamable_prefix('[{"na', mistral) == "" and streamable_prefix("It is", mistral) == "It is"
    assert streamable_prefix("It is [TOO", mistral) == "It is " and streamable_prefix("It [x]", mistral) == "It [x]"
    text = 'Sure.[TOOL_CALLS][{"name": "now", "arguments": {}}]'
    assert streamed_content(text, mistral, parse_answer(text, mistral, True)) == "Sure."
    text = '[{"name": "now", "arguments": {}}]'
    assert streamed_content(text, mistral, parse_answer(text, mistral, True)) == ""


def test_a_stream_sends_what_the_whole_answer_says_in_every_format() -> None:
    """For each parser, an answer streamed one character at a time: what may be sent only grows (nothing sent is
    taken back), and at the end the content sent is the non-streamed answer's content (up to its stripping)."""
    answers = {
        "hermes": ['Sure.<tool_call>{"name": "now", "arguments": {}}</tool_call>', "plain <b>text</b>"],
        "llama3_json": ['{"name": "now", "parameters": {}}', "plain {text}"],
        "pythonic": ["[now()]", "plain [text]", "[not a call"],
        "mistral": ['Sure.[TOOL_CALLS][{"name": "now", "arguments": {}}]', '[TOOL_CALLS]now[ARGS]{}',
                    "[1] a list", "plain text [TOOL"],
    }
    for parser, texts in answers.items():
        mode = ToolMode("auto", parser=parser)
        for text in texts:
            sent = [streamable_prefix(text[:i], mode) for i in range(len(text) + 1)]
            assert all(text.startswith(x) for x in sent), (parser, text)
            assert all(b.startswith(a) for a, b in zip(sent[:-1], sent[1:], strict=True)), (parser, text)
            answer = parse_answer(text, mode, True)
            final = streamed_content(text, mode, answer)
            assert final.startswith(sent[-1]), (parser, text)
            assert final.strip() == (answer.content or "").strip(), (parser, text)


def test_the_servers_parser_choices_are_the_formats_read() -> None:
    (flag,) = [f for f in SERVE_FLAGS if f.name == "--tool-call-parser"]
    assert flag.choices == TOOL_CALL_PARSERS
