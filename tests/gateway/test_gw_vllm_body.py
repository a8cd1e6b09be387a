"""A model whose replicas run vLLM: the real gateway process passes what vLLM serves (tools, JSON schemas, images,
tool messages, vLLM's extras) through to the replica exactly as the openai client sent it. vLLM cannot run here
(no GPU), so the replica is a small HTTP server that records the body and answers as vLLM's chat endpoint does;
the same request to a kvfleet model is refused by the gateway, naming the field."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import openai
import pytest

from kvfleet.gateway.testing import GatewayProcess

from gw_helpers import KEY_A, write_config

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


class Recorder(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:   # /health and /metrics (an empty scrape)
        self._json(200, {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.bodies.append(body)
        self._json(200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                             "role": "assistant", "content": None, "tool_calls": [{
                                 "id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}}],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    replica = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{replica.server_address[1]}"
    tmp = tmp_path_factory.mktemp("gw-vllm")
    config = write_config(tmp / "gateway.yaml", {"team-a": {"keys": [KEY_A], "models": {
        "big": {"replicas": [url], "engineKind": "vllm"}, "small": {"replicas": [url]}}}})
    gw = GatewayProcess(tmp / "gateway.log", config=config).start()
    yield gw
    gw.stop()
    replica.shutdown()


def test_vllm_features_reach_a_vllm_replica_as_sent(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30)
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "a cat"},
    ]
    extra = {"tools": TOOLS, "tool_choice": "auto", "response_format": SCHEMA,
             "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    Recorder.bodies.clear()
    got = client.chat.completions.create(model="big", messages=messages, max_tokens=8, **extra)
    assert got.choices[0].message.tool_calls[0].function.name == "lookup"
    (sent,) = Recorder.bodies
    assert sent["messages"] == messages and sent["tools"] == TOOLS and sent["tool_choice"] == "auto"
    assert sent["response_format"] == SCHEMA and sent["chat_template_kwargs"] == {"enable_thinking": False}
    # a kvfleet model behind the same gateway: checked in our engine's shapes (it reads no image), nothing sent
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="small", messages=messages[:1], max_tokens=8)
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:   # template variables a request may not set
        client.chat.completions.create(model="small", messages=messages[2:], max_tokens=8,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert info.value.param == "chat_template_kwargs"
    # what the gateway reads is checked for vLLM models too
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="big", messages=messages, max_tokens=8, temperature=-1, **extra)
    assert bad.value.param == "temperature"
    assert len(Recorder.bodies) == 1
