"""Reasoning outputs over HTTP through the real `openai` client against real `kvfleet serve` processes with
`--reasoning-parser qwen3` (a tiny random model whose tokenizer has <think> and </think> as single tokens): the
thinking comes as `reasoning` and the answer as `content`, streamed or not; `chat_template_kwargs` reach the
template (thinking off: all content); a structured output or a tool call constrains the answer after the
thinking only; a tokenizer without the markers stops the server with an error naming the flag."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import openai
import pytest

from server_proc import Server, start_server

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}")
ASK: Any = [{"role": "user", "content": "what is two and two"}]
OFF: Any = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def think_model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", added_tokens=("<think>", "</think>"))


@pytest.fixture(scope="module")
def reasoning_server(think_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("reasoning")
    (logs / "template.jinja").write_text(TEMPLATE)
    server = start_server(think_model, logs, "--max-model-len", "256", "--reasoning-parser", "qwen3",
                          "--chat-template", str(logs / "template.jinja"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(reasoning_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def end_marker(client: openai.OpenAI) -> int:
    (token,) = client.post("/../tokenize", body={"prompt": "</think>", "add_special_tokens": False},
                           cast_to=dict)["tokens"]
    return int(token)


def test_thinking_is_reasoning_and_a_stream_sends_the_same(client: openai.OpenAI) -> None:
    """The template opens the thinking; the random model never closes it in 12 tokens: all of it is reasoning,
    there is no content, and the stream's reasoning deltas join to the same text."""
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    message = got.choices[0].message.to_dict()
    assert got.choices[0].finish_reason == "length" and message["content"] is None
    assert isinstance(message["reasoning"], str) and message["reasoning"] and "<think>" not in message["reasoning"]
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0,
                                                 stream=True))
    deltas = [c.choices[0].delta.to_dict() for c in chunks if c.choices]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_thinking_off_through_chat_template_kwargs_is_all_answer(client: openai.OpenAI) -> None:
    """`enable_thinking: false` makes the template close the thinking in the prompt: the output is content."""
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0, extra_body=OFF)
    message = got.choices[0].message.to_dict()
    assert message["reasoning"] is None and message["content"]
    on = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    assert got.usage and on.usage and got.usage.prompt_tokens == on.usage.prompt_tokens + 1   # </think> shown
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.param == "chat_template_kwargs" and "chat_template_kwargs.tokenize" in \
        info.value.body["message"], info.value.body


def test_a_structured_output_and_a_tool_call_constrain_the_answer_after_the_thinking(client: openai.OpenAI) -> None:
    """A bias toward </think> ends the thinking at once (while thinking any token may come); from then on the
    constraint holds: the answer matches the regex, and a named call's arguments match the function's schema.
    Streams send the same."""
    bias = {str(end_marker(client)): 100}
    regex: Any = {"structured_outputs": {"regex": "[ab]{3} ok"}}
    got = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, temperature=0, logit_bias=bias,
                                         extra_body=regex)
    message = got.choices[0].message.to_dict()
    assert message["reasoning"] == "" and re.fullmatch("[ab]{3} ok", message["content"]), message
    assert got.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=20, temperature=0,
                                                 logit_bias=bias, extra_body=regex, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message["content"]
    tool: Any = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    call = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=30, temperature=0, logit_bias=bias,
                                          tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}})
    (tool_call,) = call.choices[0].message.tool_calls or []
    assert tool_call.function.name == "add" and isinstance(json.loads(tool_call.function.arguments)["a"], int)
    assert call.choices[0].message.to_dict()["reasoning"] == ""


def test_the_responses_api_tells_the_thinking_as_a_reasoning_item(client: openai.OpenAI) -> None:
    """/v1/responses on the same server: the thinking cut off by max_output_tokens is one reasoning item, the chat
    answer's reasoning, every output token counted as reasoning; a stream's reasoning deltas join to it."""
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=0)
    got = client.responses.create(model="tiny", input=ASK, max_output_tokens=12, temperature=0)
    (item,) = got.output
    assert item.type == "reasoning" and item.content is not None
    assert item.content[0].text == chat.choices[0].message.to_dict()["reasoning"]
    assert got.usage is not None and got.usage.output_tokens == 12 and got.status == "incomplete"
    assert got.usage.output_tokens_details.reasoning_tokens == 12
    events = list(client.responses.create(model="tiny", input=ASK, max_output_tokens=12, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning"] and final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == 12


def test_a_tokenizer_without_the_markers_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as info:
        start_server(tiny_model_dir, tmp_path, "--reasoning-parser", "deepseek_r1", ready_timeout=120)
    assert "--reasoning-parser deepseek_r1: the model's tokenizer has no <think> or </think> token" in \
        str(info.value)
