"""Tool calling over HTTP through the real `openai` client against real `kvfleet serve` processes (tiny random
model): a named or required tool choice is answered with tool calls whose arguments match the function's schema
(streamed too), what the request's tools and earlier calls look like to the chat template, and `auto`, which needs
the server's tool-call parser (a 400 naming tool_choice without it, vLLM's rule)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import openai
import pytest

from server_proc import Server, start_server

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "rain": {"type": "boolean"}},
                   "required": ["unit", "rain"], "additionalProperties": False}}}
CLOCK: Any = {"type": "function", "function": {"name": "now"}}
ASK: Any = [{"role": "user", "content": "what is the weather"}]
# A template that shows tools and earlier calls (as Qwen's does, shorter): what the model is shown is visible in
# the prompt's token count.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def check_weather_call(call: Any) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    args = json.loads(call.function.arguments)
    assert set(args) == {"unit", "rain"} and args["unit"] in ("C", "F") and isinstance(args["rain"], bool)


def test_a_named_function_is_called_with_arguments_of_its_schema(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                         tools=[WEATHER, CLOCK], tool_choice=named, logprobs=True, top_logprobs=2)
    message = got.choices[0].message
    assert message.content is None and len(message.tool_calls or []) == 1 and got.choices[0].finish_reason == "stop"
    check_weather_call((message.tool_calls or [])[0])
    stream = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=40, temperature=0,
                                            tools=[WEATHER, CLOCK], tool_choice=named, stream=True,
                                            logprobs=True, top_logprobs=2)
    chunks = list(stream)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert len(calls) == 1 and calls[0].function.arguments == (message.tool_calls or [])[0].function.arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    # the call is held back until it is whole, its tokens' logprobs are not: they come with the chunk that is sent
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    whole = (got.choices[0].logprobs and got.choices[0].logprobs.content) or []
    assert got.usage is not None and len(whole) == got.usage.completion_tokens > 0
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)


def test_required_calls_are_one_or_more_of_the_tools(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                         tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    calls = got.choices[0].message.tool_calls or []
    assert len(calls) == 1 and got.choices[0].finish_reason == "tool_calls"
    if calls[0].function.name == "get_weather":
        check_weather_call(calls[0])
    else:
        assert calls[0].function.name == "now" and json.loads(calls[0].function.arguments) == {}


def test_auto_needs_the_servers_parser_and_bad_choices_name_the_field(client: openai.OpenAI) -> None:
    for extra, says in (({"tools": [WEATHER]}, "--enable-auto-tool-choice"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "'nope' is not among the tools"),
                        ({"tool_choice": "required"}, "needs tools"),
                        ({"tools": [WEATHER], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "not both")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **extra)
        assert info.value.param == "tool_choice" and says in info.value.body["message"], info.value.body
    bad_schema: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, tools=[bad_schema],
                                       tool_choice="required")
    assert info.value.param == "tools" and info.value.body["message"].startswith("tools: a function's parameters")
    # none: text, as without tools
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0, tools=[WEATHER],
                                          tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def auto_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("auto-tools")
    (logs / "template.jinja").write_text(TEMPLATE)
    server = start_server(tiny_model_dir, logs, "--max-model-len", "512", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes", "--chat-template", str(logs / "template.jinja"))
    yield server
    server.stop()


def test_auto_with_the_hermes_parser_and_what_the_template_is_shown(auto_server: Server) -> None:
    """`auto` is served with the parser (the random model writes no call: its text is the content); the template
    is shown the tools and an earlier call with its arguments as an object."""
    auto = openai.OpenAI(base_url=auto_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    bare = auto.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0)
    with_tools = auto.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0,
                                              tools=[WEATHER])
    assert with_tools.choices[0].message.tool_calls is None and with_tools.choices[0].message.content is not None
    assert with_tools.choices[0].finish_reason in ("stop", "length")
    shown = json.dumps(WEATHER)   # the template writes each tool as JSON: its tokens are in the prompt
    assert (with_tools.usage.prompt_tokens - bare.usage.prompt_tokens) >= len(shown) // 4
    history: Any = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    follow = auto.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                          tools=[WEATHER])
    assert follow.usage.prompt_tokens > with_tools.usage.prompt_tokens
    stream = auto.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0,
                                          tools=[WEATHER], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        with_tools.choices[0].message.content


# Mistral's way, shorter: tools in [AVAILABLE_TOOLS], calls after the special [TOOL_CALLS] token with their ids, and
# its templates' rule that every call id is 9 letters and digits.
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments, 'id': c.id} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")
CALL_TEXT = '{"name": "get_weather", "arguments": {"unit": "C", "rain": true}}'


@pytest.fixture(scope="module")
def mistral_client(tiny_model_factory: Callable[..., Path],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A server with the mistral parser on a tiny model whose tokenizer has [TOOL_CALLS] as a special token."""
    logs = tmp_path_factory.mktemp("mistral-tools")
    (logs / "template.jinja").write_text(MISTRAL_TEMPLATE)
    model = tiny_model_factory("llama", special_tokens=("[TOOL_CALLS]",))
    server = start_server(model, logs, "--max-model-len", "512", "--enable-auto-tool-choice",
                          "--tool-call-parser", "mistral", "--chat-template", str(logs / "template.jinja"))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    server.stop()


def mistral_call_grammar(client: openai.OpenAI) -> dict[str, Any]:
    """A Lark grammar (vLLM's structured_outputs extra) that makes the random model write what a Mistral model
    writes for a call: the [TOOL_CALLS] token itself (by id), then the JSON list."""
    (tag,) = client.post("/../tokenize", body={"prompt": "[TOOL_CALLS]", "add_special_tokens": False},
                         cast_to=dict)["tokens"]
    literal = json.dumps(" [" + CALL_TEXT + "]")
    return {"structured_outputs": {"grammar": f"start: <[{tag}]> {literal}"}}


def test_mistral_calls_are_read_with_mistral_ids_and_sent_back(mistral_client: openai.OpenAI) -> None:
    """An auto answer that is [TOOL_CALLS] and a JSON list comes back as a call (the special token is kept for the
    parser, vLLM's rule) with a 9-character id, streamed the same; the conversation with that call and its result
    renders under Mistral's id rule, and one with another server's id is a 400 naming messages."""
    grammar = mistral_call_grammar(mistral_client)
    got = mistral_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                                 tools=[WEATHER, CLOCK], extra_body=grammar)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"unit": "C", "rain": True}
    assert len(call.id) == 9 and call.id.isalnum(), call.id
    chunks = list(mistral_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                                         tools=[WEATHER, CLOCK], extra_body=grammar, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name if tc.function else None, tc.function.arguments if tc.function else None)
            for tc in streamed] == [("get_weather", call.function.arguments)]
    assert streamed[0].id is not None and len(streamed[0].id) == 9 and streamed[0].id.isalnum()
    history: Any = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "rain, 12 C"}]
    follow = mistral_client.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0,
                                                    tools=[WEATHER])
    assert follow.usage is not None and got.usage is not None
    assert follow.usage.prompt_tokens > got.usage.prompt_tokens
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "chatcmpl-tool-0123456789abcdef"
    with pytest.raises(openai.BadRequestError) as info:
        mistral_client.chat.completions.create(model="tiny", messages=history, max_tokens=4, tools=[WEATHER])
    assert info.value.param == "messages" and "length 9" in info.value.body["message"], info.value.body


def test_mistral_special_tokens_are_kept_only_for_auto_tool_answers(mistral_client: openai.OpenAI) -> None:
    """Without tools (or with tool_choice none) the same output is decoded as always, special tokens skipped: no
    [TOOL_CALLS] text and no call."""
    grammar = mistral_call_grammar(mistral_client)
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        got = mistral_client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                                     extra_body=grammar, **extra)
        message = got.choices[0].message
        assert message.tool_calls is None and message.content == " [" + CALL_TEXT + "]", (extra, message)
        assert got.choices[0].finish_reason == "stop"
