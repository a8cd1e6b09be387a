"""OpenAI's Responses API (`POST /v1/responses`) through the real gateway process: keys, bodies checked in the
engine's shapes, the answer and its stream passed through as the replica sent them (the usage event kept, no `[DONE]`
added), the usage counted against a tenant's token limit, prefix routing, a retry, a replica dying mid-stream, and a
vLLM model's body passed on as sent. The replicas are fast upstreams (`kvfleet.gateway.testing`), one that dies
mid-stream and one that records what it gets (small HTTP servers in this process)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import httpx
import pytest
from openai import OpenAI

from kvfleet.gateway.testing import RESPONSE_INPUT_TOKENS, GatewayProcess, response_events, wait_until

from gw_helpers import KEY_A, KEY_B, write_config

pytestmark = pytest.mark.timeout(120)

KEY_C = "team-c-key-0123456789"
DEAD = "http://127.0.0.1:1"   # nothing listens; its name sorts before any other replica's: short prompts try it first


def typed(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class Replica(BaseHTTPRequestHandler):
    """Model `cut`: a Responses stream that stops after 6 events (the connection closes, as a dying replica's).
    Any other model: records the body and answers a response with usage 9 + 3."""

    bodies: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:   # /metrics: an empty scrape
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["model"] == "cut":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"".join(typed(e) for e in response_events(body, 3)[:6]))
            return   # HTTP/1.0: the connection closes here, mid-stream
        Replica.bodies.append(body)
        answer = {"id": "resp_1", "object": "response", "status": "completed", "output": [], "model": body["model"],
                  "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def gw(fast_upstream_pair: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Replica) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    cut, recorder = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    first, _ = fast_upstream_pair
    tmp = tmp_path_factory.mktemp("gw-responses")
    config = write_config(tmp / "gateway.yaml", {
        "team-a": {"keys": [KEY_A], "models": {
            "fast": {"replicas": list(fast_upstream_pair)}, "retry": {"replicas": [DEAD, first]},
            "cut": {"replicas": [cut]}, "big": {"replicas": [recorder], "engineKind": "vllm"},
            "small": {"replicas": [recorder]}}},
        "team-b": {"keys": [KEY_B], "limits": {"tokensPerMinute": 10}, "models": {"fast": {"replicas": [first]}}},
        "team-c": {"keys": [KEY_C], "limits": {"tokensPerMinute": 8}, "models": {"fast": {"replicas": [first]}}},
    })
    gateway = GatewayProcess(tmp / "gateway.log", config=config, args=["--scrape-interval", "0.2"]).start()
    yield gateway
    gateway.stop()
    for server in servers:
        server.shutdown()


def post(gw: GatewayProcess, body: Any, key: str = KEY_A) -> httpx.Response:
    return httpx.post(gw.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def tokens(gw: GatewayProcess, kind: str, **labels: str) -> float:
    return gw.metric(f"kvfleet_gateway_{kind}_tokens_total", **labels)


def test_responses_need_a_key_and_a_valid_body_before_anything_goes_upstream(gw: GatewayProcess) -> None:
    body = {"model": "fast", "input": "hi"}
    for headers in ({}, {"Authorization": "Bearer not-a-key-0000000000"}):
        resp = httpx.post(gw.url + "/v1/responses", json=body, headers=headers)
        assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "invalid_api_key"
    routed = gw.metric("kvfleet_gateway_routing_decisions_total")
    for bad, field, code in (({"input": []}, "input", "invalid_value"),
                             ({"stream_options": {"include_usage": True}}, "stream_options", "unknown_field"),
                             ({"n": 2}, "n", "unknown_field"),
                             ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
                             ({"previous_response_id": "resp_1"}, "previous_response_id", "invalid_value"),
                             ({"model": None}, "model", "missing_field")):
        resp = post(gw, {**body, **bad})
        error = resp.json()["error"]
        assert (resp.status_code, error["param"], error["code"], error["type"]) == (
            400, field, code, "invalid_request_error"), bad
    missing = post(gw, {**body, "model": "nope"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert gw.metric("kvfleet_gateway_routing_decisions_total") == routed   # nothing went upstream
    wrong = httpx.get(gw.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_A}"})
    assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"


def test_a_response_passes_through_and_its_usage_counts(gw: GatewayProcess,
                                                        fast_upstream_pair: tuple[str, str]) -> None:
    prompt, completion = tokens(gw, "prompt", tenant="team-a"), tokens(gw, "completion", tenant="team-a")
    body = {"model": "fast", "instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}]}
    got = post(gw, body)
    want = httpx.post(fast_upstream_pair[0] + "/v1/responses", json=body)
    assert got.status_code == 200 and got.content == want.content
    assert got.headers["x-kvfleet-replica"] in fast_upstream_pair
    reply = OpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30).responses.create(
        model="fast", input="hi")
    assert reply.output_text == "x" and reply.usage is not None and reply.usage.output_tokens == 1
    # the usage of both (input_tokens, output_tokens) is counted as they were answered
    assert tokens(gw, "prompt", tenant="team-a") - prompt == 2 * RESPONSE_INPUT_TOKENS
    assert tokens(gw, "completion", tenant="team-a") - completion == 2


def test_a_responses_stream_passes_through_byte_equal_with_its_usage_event(gw: GatewayProcess,
                                                                          fast_upstream_pair: tuple[str, str]) -> None:
    prompt, completion = tokens(gw, "prompt", tenant="team-a"), tokens(gw, "completion", tenant="team-a")
    body = {"model": "fast", "input": "hi", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        got = resp.read()
    want = httpx.post(fast_upstream_pair[0] + "/v1/responses", json=body).content   # (no stream_options: else 400)
    assert got == want and b"[DONE]" not in got
    last = got.split(b"\n\n")[-2]
    assert last.startswith(b"event: response.completed\ndata: ")
    assert json.loads(last.split(b"data: ", 1)[1])["response"]["usage"]["output_tokens"] == 3
    wait_until("the stream's usage counted", lambda: tokens(gw, "completion", tenant="team-a") - completion == 3,
               timeout=10)
    assert tokens(gw, "prompt", tenant="team-a") - prompt == RESPONSE_INPUT_TOKENS
    stream = OpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0, timeout=30).responses.create(
        model="fast", input="hi", stream=True)
    kinds = [event.type for event in stream]
    assert kinds.count("response.output_text.delta") == 3 and kinds[-1] == "response.completed"


def test_a_tenants_token_limit_counts_the_usage_of_responses(gw: GatewayProcess) -> None:
    """team-b may use 10 tokens a minute: one stream uses 7 + 3 (its last event's usage); team-c 8: one answer
    uses 7 + 1 (its body's). The next request of each is refused, naming the tokens the engine counted."""
    for key, tenant, stream, used in ((KEY_B, "team-b", True, 10), (KEY_C, "team-c", False, 8)):
        assert post(gw, {"model": "fast", "input": "hi", "stream": stream}, key).status_code == 200
        def counted(tenant: str = tenant, used: int = used) -> bool:
            return tokens(gw, "prompt", tenant=tenant) + tokens(gw, "completion", tenant=tenant) == used

        wait_until(f"{tenant}'s usage counted", counted, timeout=10)
        refused = post(gw, {"model": "fast", "input": "hi"}, key)
        error = refused.json()["error"]
        assert refused.status_code == 429 and error["code"] == "rate_limit_exceeded", refused.text
        assert f"(tokensPerMinute: {used} in the last 60s)" in error["message"]
        assert int(refused.headers["Retry-After"]) >= 1


def test_responses_sharing_long_instructions_land_where_their_prefix_is(gw: GatewayProcess) -> None:
    """By prefix, as chats do: the same conversation sent as a chat lands there too (the same prompt text)."""
    system = "You are the ACME support assistant. " * 30   # ~1100 characters: 4 prefix blocks
    before = gw.metric("kvfleet_gateway_routing_decisions_total", model="fast", rule="prefix")
    served = set()
    for question in ("Where is my order?", "How do I reset my password?", "Can I pay by card?"):
        resp = post(gw, {"model": "fast", "instructions": system, "input": question})
        assert resp.status_code == 200
        served.add(resp.headers["x-kvfleet-replica"])
    chat = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"}, json={
        "model": "fast", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]})
    served.add(chat.headers["x-kvfleet-replica"])
    assert len(served) == 1
    # the first by the ring (nothing cached yet), the others by the prefix the first left
    assert gw.metric("kvfleet_gateway_routing_decisions_total", model="fast", rule="prefix") - before == 3


def test_a_dead_replica_is_retried_before_a_responses_stream_begins(gw: GatewayProcess) -> None:
    with httpx.stream("POST", gw.url + "/v1/responses", json={"model": "retry", "input": "hi", "stream": True},
                      headers={"Authorization": f"Bearer {KEY_A}"}, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] != DEAD
        got = resp.read()
    assert got.split(b"\n\n")[-2].startswith(b"event: response.completed\n")
    assert gw.metric("kvfleet_gateway_upstream_retries_total", model="retry") == 1


def test_a_replica_dying_mid_stream_ends_it_with_a_responses_error_event(gw: GatewayProcess) -> None:
    body = {"model": "cut", "input": "hi", "stream": True}
    with httpx.stream("POST", gw.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_A}"},
                      timeout=30) as resp:
        assert resp.status_code == 200
        got = resp.read()
    sent = b"".join(typed(e) for e in response_events(body, 3)[:6])   # numbers 0-5, two of them text deltas
    assert got.startswith(sent) and b"[DONE]" not in got
    ending = got[len(sent):]
    assert ending.startswith(b"event: error\ndata: ") and ending.endswith(b"\n\n")
    error = json.loads(ending.split(b"data: ", 1)[1])
    assert (error["type"], error["code"], error["sequence_number"]) == ("error", "upstream_disconnected", 6)
    # no usage event came: the deltas sent count, as a chat stream's chunks do
    wait_until("the cut stream's tokens counted", lambda: tokens(gw, "completion", model="cut") == 2, timeout=10)
    assert gw.metric("kvfleet_gateway_request_errors_total", model="cut", reason="upstream_disconnected") == 1


def test_a_vllm_model_gets_a_responses_body_as_sent(gw: GatewayProcess) -> None:
    """What vLLM's Responses API takes and ours does not (images, references, built-in tools, stored responses)."""
    body = {"model": "big", "store": True, "previous_response_id": "resp_0", "tools": [{"type": "web_search"}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                   {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
                      {"type": "item_reference", "id": "msg_1"}]}
    Replica.bodies.clear()
    prompt = tokens(gw, "prompt", model="big")
    assert post(gw, body).status_code == 200
    assert Replica.bodies == [body] and tokens(gw, "prompt", model="big") - prompt == 9
    mine = post(gw, {**body, "model": "small"})   # our engine's model: refused here, naming the field
    assert (mine.status_code, mine.json()["error"]["param"]) == (400, "input")
    bad = post(gw, {**body, "max_output_tokens": 0})   # what the gateway reads is checked for vLLM's too
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "max_output_tokens")
    assert len(Replica.bodies) == 1
