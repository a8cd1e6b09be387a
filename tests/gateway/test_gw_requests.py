"""Bodies checked with the engine's shapes before any upstream call; the upstream body."""

from __future__ import annotations

import json

import pytest

from kvfleet.engine.server.error_shapes import APIError
from kvfleet.gateway.requests import parse_request, token_estimate, upstream_body

CHAT = "/v1/chat/completions"


def refused(path: str, raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(path, raw)
    assert info.value.status == 400
    return info.value


def test_errors_name_the_field_like_the_engine() -> None:
    err = refused(CHAT, b'{"model": "m", "messages": [], "temperature": 3}')
    assert (err.param, err.code) == ("messages", "invalid_value")
    err = refused(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 1}')
    assert (err.param, err.code, err.message) == ("temprature", "unknown_field", "Unknown field 'temprature'")
    err = refused(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": []}')
    assert (err.param, err.code) == ("functions", "unsupported_field")
    assert err.message == "'functions' is not supported by this server"
    err = refused("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": "5"}')
    assert err.param == "max_tokens"
    err = refused(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}')
    assert err.param == "stream_options"


def test_body_problems() -> None:
    assert refused(CHAT, b"").code == "missing_body"
    assert refused(CHAT, b"{not json").code == "invalid_json"
    assert refused(CHAT, b"\xff\xfe{}").code == "invalid_json"
    assert refused(CHAT, b"[1, 2]").message == "The request body must be a JSON object (Content-Type: application/json)"
    err = refused(CHAT, b'{"messages": [{"role": "user", "content": "x"}]}')
    assert (err.param, err.code) == ("model", "missing_field")
    assert refused(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}').param == "messages"


def test_upstream_body_renames_and_asks_a_stream_for_usage() -> None:
    raw = b'{"model": "team-a/chat", "messages": [{"role": "user", "content": "x"}], "stream": true}'
    req = parse_request(CHAT, raw)
    assert req.stream and not req.wants_usage
    body = json.loads(upstream_body(req, "smollm2", raw))
    assert body["model"] == "smollm2" and body["stream_options"] == {"include_usage": True}


def test_upstream_body_is_the_clients_when_nothing_changes() -> None:
    raw = b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": true}}'
    req = parse_request("/v1/completions", raw)
    assert req.wants_usage and upstream_body(req, "m", raw) is raw
    raw = b'{"model": "m", "prompt": "x"}'
    assert upstream_body(parse_request("/v1/completions", raw), "m", raw) is raw


def test_tokenize_and_detokenize_bodies() -> None:
    raw = b'{"model": "team-a/chat", "messages": [{"role": "user", "content": "x"}]}'
    req = parse_request("/tokenize", raw)
    assert req.generation is None and not req.stream and not req.wants_usage
    assert token_estimate(req) == (0.0, 0.0)   # no model runs: no tokens charged
    assert json.loads(upstream_body(req, "smollm2", raw))["model"] == "smollm2"
    assert parse_request("/detokenize", b'{"model": "m", "tokens": [1, 2]}').model == "m"
    assert refused("/tokenize", b'{"prompt": "x"}').param == "model"
    assert refused("/tokenize", b'{"model": "m", "prompt": "x", "messages": []}').param == "prompt"
    assert refused("/detokenize", b'{"model": "m", "tokens": [-1]}').param == "tokens"
    assert refused("/detokenize", b'{"model": "m", "tokens": "12"}').param == "tokens"


VLLM_CHAT = {
    "model": "m", "temperature": 0.2, "stream": True, "stream_options": {"include_usage": True},
    "messages": [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_a_vllm_model_takes_what_vllm_serves_and_the_gateway_reads_only_its_part() -> None:
    """Tools, JSON schemas, images, tool messages and vLLM's extras reach a vLLM replica as the client sent them; our
    engine's models refuse them by name."""
    raw = json.dumps(VLLM_CHAT).encode()
    assert refused(CHAT, raw).param in ("messages", "tools")   # the tool message, or the tools
    req = parse_request(CHAT, raw, vllm=True)
    assert req.body == VLLM_CHAT and req.model == "m" and req.stream and req.wants_usage
    assert upstream_body(req, "m", raw) == raw   # untouched: the replica checks what the gateway did not
    # the estimate reads the text only: 4 messages' overhead + the system and user texts (the image is not text)
    # + the tools as JSON (the template shows them)
    prompt, _ = token_estimate(req)
    text = len("Use the tool.") + len("What is in this picture?") + len("a cat") + len(json.dumps(VLLM_CHAT["tools"]))
    assert prompt == text / 4 + 16
    # what the gateway reads is still checked, naming the field
    for bad, field in (({"temperature": "hot"}, "temperature"), ({"messages": "hi"}, "messages"),
                       ({"stream_options": {"include_usage": "yes"}}, "stream_options")):
        with pytest.raises(APIError) as info:
            parse_request(CHAT, json.dumps({**VLLM_CHAT, **bad}).encode(), vllm=True)
        assert info.value.param == field


def test_a_kvfleet_model_takes_json_modes_in_the_engines_shapes() -> None:
    """Our engine serves response_format's JSON modes and vLLM's structured_outputs: the gateway passes them on
    (compiling the constraint is the engine's: its 400 comes back through); malformed ones are refused here."""
    msgs = [{"role": "user", "content": "x"}]
    for extra in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
                  {"response_format": {"type": "json_object"}},
                  {"structured_outputs": {"regex": "[a-z]+"}}):
        raw = json.dumps({"model": "m", "messages": msgs, **extra}).encode()
        req = parse_request(CHAT, raw)
        assert upstream_body(req, "m", raw) == raw
    for bad, field in (({"response_format": {"type": "json_schema"}}, "response_format"),
                       ({"response_format": {"type": "yaml"}}, "response_format"),
                       ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
                       ({"guided_json": {}}, "guided_json")):
        assert refused(CHAT, json.dumps({"model": "m", "messages": msgs, **bad}).encode()).param == field


# -- the Responses API ------------------------------------------------------------------------------------------

RESPONSES = "/v1/responses"


def test_responses_bodies_are_refused_naming_the_field_like_the_engine() -> None:
    for body, field, code in (
            ({"model": "m", "input": []}, "input", "invalid_value"),
            ({"model": "m"}, "input", "missing_field"),
            ({"input": "x"}, "model", "missing_field"),
            ({"model": "m", "input": "x", "n": 2}, "n", "unknown_field"),   # one answer only
            ({"model": "m", "input": "x", "stream_options": {"include_usage": True}}, "stream_options",
             "unknown_field"),   # the API has no such field
            ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
            ({"model": "m", "input": "x", "stream": "yes"}, "stream", "invalid_value"),
            ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
             "invalid_value"),   # nothing is stored
            ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "invalid_value"),
            ({"model": "m", "input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
             "missing_field"),   # a chat-shaped tool: the Responses API's are flat
    ):
        err = refused(RESPONSES, json.dumps(body).encode())
        assert (err.param, err.code) == (field, code), body


def test_a_responses_stream_gets_its_usage_without_asking_and_its_body_is_the_clients() -> None:
    raw = b'{"model": "m", "input": "hi", "stream": true}'
    req = parse_request(RESPONSES, raw)
    assert req.responses is req.parsed and req.generation is req.parsed
    assert req.stream and req.wants_usage   # the last event carries it: nothing to add, nothing to strip
    assert upstream_body(req, "m", raw) is raw
    body = json.loads(upstream_body(req, "smollm2", raw))
    assert body == {"model": "smollm2", "input": "hi", "stream": True}   # renamed; no stream_options
    assert parse_request(CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}').responses is None


TOOLS = [{"type": "function", "name": "lookup", "description": "Find it.", "parameters": {"type": "object"}}]
CONVERSATION = {
    "model": "m", "instructions": "I" * 40, "tools": TOOLS,
    "input": [
        {"role": "user", "content": "a" * 20},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b" * 8},
                                                             {"type": "output_text", "text": "c" * 4}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s" * 100}],
         "content": [{"type": "reasoning_text", "text": "r" * 12}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "abc"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "o" * 16},
    ],
}


def test_the_responses_estimate_counts_every_text_of_the_conversation_and_the_tools() -> None:
    req = parse_request(RESPONSES, json.dumps(CONVERSATION).encode())
    prompt, completion = token_estimate(req)
    # instructions, the messages' text parts, the reasoning's content (what the engine shows; its summary only
    # without content), the call's arguments, its output; 4 per turn (6: the instructions are one) as a chat's
    # messages; the tools as their JSON
    text = 40 + 20 + 8 + 4 + 12 + len('{"q": "abc"}') + 16
    assert prompt == text / 4 + 4 * 6 + len(json.dumps(TOOLS)) / 4
    assert completion == 256.0   # no max_output_tokens: the chat's default
    for limit, want in ((100, 100.0), (10**6, 4096.0)):
        body = {"model": "m", "input": "hello", "max_output_tokens": limit}
        assert token_estimate(parse_request(RESPONSES, json.dumps(body).encode())) == (5 / 4 + 4, want)


VLLM_RESPONSES = {
    "model": "m", "stream": True, "store": True, "previous_response_id": "resp_0",
    "include": ["file_search_call.results"], "tools": [{"type": "web_search"}, *TOOLS],
    "tool_choice": {"type": "web_search"}, "background": False,
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "a cat"}, {"type": "input_image", "image_url": "x"}]},
    ],
}


def test_a_reasoning_items_parts_count_as_the_engine_joins_them() -> None:
    """The engine shows a reasoning item's parts to the model one per line; the gateway's estimate and prefix text
    read them the same way."""
    from kvfleet.engine.server.protocol_responses import ResponsesRequest
    from kvfleet.engine.server.responses_api import chat_messages
    from kvfleet.gateway.responses_api import turns

    body = {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "first"}, {"type": "reasoning_text", "text": "second"}]},
        {"role": "assistant", "content": "hello"}]}
    req = ResponsesRequest.model_validate(body)
    assert turns(req)[1].text == chat_messages(req)[1]["reasoning"] == "first\nsecond"


def test_a_vllm_model_takes_what_vllms_responses_api_serves_and_the_gateway_reads_only_its_text() -> None:
    """Images, references, built-in tools and stored responses reach a vLLM replica as the client sent them (our
    engine's model refuses them by name); what the gateway reads is still checked, naming the field."""
    raw = json.dumps(VLLM_RESPONSES).encode()
    assert refused(RESPONSES, raw).param == "input"
    req = parse_request(RESPONSES, raw, vllm=True)
    assert req.body == VLLM_RESPONSES and req.model == "m" and req.stream and req.wants_usage
    assert upstream_body(req, "m", raw) == raw
    prompt, _ = token_estimate(req)   # the texts only (3 turns the gateway reads), the tools as sent
    assert prompt == (len("What is in this picture?") + len("a cat")) / 4 + 4 * 3 + len(
        json.dumps(VLLM_RESPONSES["tools"])) / 4
    only_others = {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}
    assert parse_request(RESPONSES, json.dumps(only_others).encode(), vllm=True).body == only_others
    for bad, field in (({"stream": "yes"}, "stream"), ({"max_output_tokens": 0}, "max_output_tokens"),
                       ({"instructions": 5}, "instructions"), ({"input": 5}, "input"), ({"model": None}, "model"),
                       ({"input": [{"type": "function_call", "call_id": "c2", "name": "f"}]}, "input")):
        with pytest.raises(APIError) as info:
            parse_request(RESPONSES, json.dumps({**VLLM_RESPONSES, **bad}).encode(), vllm=True)
        assert info.value.param == field, bad
