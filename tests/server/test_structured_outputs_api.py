"""Structured outputs over HTTP, through the real `openai` client against real `kvfleet serve` processes: OpenAI's
`response_format` (JSON object, JSON schema, the client's own `parse` with a pydantic model; on SmolLM2 also a
named tool call) and vLLM's
`structured_outputs` extra (JSON without whitespace, choice, regex; streamed too). On the tiny random model each
answer is what the offline engine gives with the same constraint; on the real SmolLM2 weights the client's `parse`
gets its pydantic model back; a bad constraint is a 400 naming the field as the request spelled it.

(JSON allows whitespace between tokens, as vLLM's default: a random model may emit whitespace until max_tokens, so
its complete documents are asked for without it, vLLM's `disable_any_whitespace`.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from kvfleet.engine.sampling_params import SamplingParams, StructuredOutputsParams

from server_proc import Server, start_server

CHAT: Any = [{"role": "user", "content": "the weather report"}]
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]},
                                           "windy": {"type": "boolean"}},
          "required": ["sky", "windy"], "additionalProperties": False}


class Verdict(BaseModel):
    verdict: Literal["yes", "no"]
    sure: bool


def offline_chat(offline: Any, spec: StructuredOutputsParams, max_tokens: int = 60) -> Any:
    return offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec))[0] \
        .outputs[0]


def test_json_schema_and_json_object(client: openai.OpenAI, offline: Any) -> None:
    """response_format's JSON schema and JSON object: the offline engine's answers with the same constraint."""
    for fmt, spec in (({"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
                       StructuredOutputsParams(json=SCHEMA)),
                      ({"type": "json_object"}, StructuredOutputsParams(json_object=True))):
        got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0,
                                             response_format=fmt)  # type: ignore[arg-type]
        text = got.choices[0].message.content or ""
        assert text == offline_chat(offline, spec).text and text.startswith("{"), fmt
    compact = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    value = json.loads(compact.choices[0].message.content or "")
    assert value["sky"] in ("clear", "cloudy", "rain") and isinstance(value["windy"], bool)
    assert set(value) == {"sky", "windy"} and compact.choices[0].finish_reason == "stop"


def test_the_token_table_is_built_before_the_server_is_ready(api_server: Server) -> None:
    """llguidance's view of the tokenizer is built during start-up, before /health turns 200, so the first
    constrained request does not pay for it."""
    log = api_server.log.read_text(errors="replace")
    assert "token table built" in log and "model ready" in log, api_server.log_tail()
    assert log.index("token table built") < log.index("model ready")


@pytest.mark.slow
def test_the_clients_parse_helper_gets_its_pydantic_model_from_real_weights(
        smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The embedded SmolLM2-135M-Instruct served for real: `client.chat.completions.parse(response_format=Model)`
    sends Model's strict JSON schema and parses the answer back into Model; JSON mode gives an object."""
    server = start_server(smollm2_path, tmp_path_factory.mktemp("smollm2-logs"), "--max-model-len", "512")
    try:
        real = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        ask: Any = [{"role": "user", "content": "Is Paris the capital of France? Answer as JSON."}]
        parsed = real.chat.completions.parse(model="tiny", messages=ask, max_tokens=64, temperature=0,
                                             response_format=Verdict)
        answer = parsed.choices[0].message.parsed
        assert isinstance(answer, Verdict) and parsed.choices[0].finish_reason == "stop"
        mode = real.chat.completions.create(model="tiny", messages=ask, max_tokens=64, temperature=0,
                                            response_format={"type": "json_object"})
        assert mode.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(mode.choices[0].message.content or ""), dict)
        # a named tool call (its arguments are a structured output of the function's schema)
        tool: Any = {"type": "function", "function": {"name": "get_capital", "parameters": {
            "type": "object", "properties": {"country": {"type": "string", "maxLength": 40}},
            "required": ["country"], "additionalProperties": False}}}
        called = real.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is the capital of France? Use the tool."}],
            tools=[tool], tool_choice={"type": "function", "function": {"name": "get_capital"}}, max_tokens=48,
            temperature=0)
        (call,) = called.choices[0].message.tool_calls or []
        assert call.function.name == "get_capital"
        assert isinstance(json.loads(call.function.arguments)["country"], str)
    finally:
        server.stop()


def test_vllm_structured_outputs_choice_and_regex_streamed(client: openai.OpenAI, offline: Any) -> None:
    choices = ["north", "south", "east or west"]
    got = client.completions.create(model="tiny", prompt="go", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"choice": choices}})
    expected = offline.generate("go", SamplingParams(temperature=0.0, max_tokens=20,
                                                     structured_outputs=StructuredOutputsParams(choice=choices)))
    assert got.choices[0].text == expected[0].outputs[0].text and got.choices[0].text in choices
    regex = r"[A-Z]{2}-[0-9]{3}"
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=1.0, seed=4,
                                            n=2, stream=True, extra_body={"structured_outputs": {"regex": regex}})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert all(re.fullmatch(regex, t) for t in texts), texts


def test_bad_constraints_are_a_400_naming_the_field_as_sent(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "response_format.json_schema.schema: "),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(("}}}, "structured_outputs",
         "structured_outputs.regex: "),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs",
         "give exactly one"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
         "structured_outputs", "not both"),
    ]
    for extra, param, says in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, **extra)
        assert info.value.param == param and says in info.value.message, (extra, info.value.body)
        assert "\n" not in info.value.message
