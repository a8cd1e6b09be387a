"""Scenario: the gateway on the local cluster, in front of real engines, with the real `openai` client.

Two tenants each get a ModelDeployment serving `chat` (the same name); their engine pods run real
`kvfleet serve` processes (the cluster's engine kubelet, tiny model). The gateway (a local process, loopback
only) watches Tenants, ModelDeployments, pods and the key Secrets of its key namespace. Checked: 401 without
or with a wrong key, each tenant sees and reaches only its own `chat` (404 for the other's), a key added to
a Secret works and a removed one stops working without a restart, a client that leaves aborts the engine's
request, a replica whose engine died is retried on the other, a replica killed mid-stream ends the stream
with an error event, a constrained request (structured outputs) is answered within its constraint, and OpenAI's
Responses API reaches the engine with its tokens counted.
"""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.gateway.testing import GatewayProcess, metric_sum
from kvfleet.operator.kube import Kube
from kvfleet.operator.testing import wait_for

from local_engines import engines
from operator_fixtures import API, model_deployment

pytestmark = pytest.mark.timeout(600)

LONG = {"max_tokens": 600, "extra_body": {"min_tokens": 600, "ignore_eos": True}}
MSG = [{"role": "user", "content": "Say something."}]


def secret(ns: str, name: str, keys: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}}


def new_key(who: str) -> str:
    return f"{who}-{uuid.uuid4().hex}"


class Setup:
    def __init__(self, kube: Kube, kubectl: Callable[..., Any], tenants: Any, flavors: dict[str, str], cluster: Any,
                 keys_ns: str) -> None:
        self.kube, self.kubectl, self.cluster, self.keys_ns = kube, kubectl, cluster, keys_ns
        self.key_a, self.key_b = new_key("team-a"), new_key("team-b")
        self.write_keys("a-keys", {"k1": self.key_a})
        self.write_keys("b-keys", {"k1": self.key_b})
        quota = [{"flavor": flavors["h200"], "nominal": 4}]
        # each tenant's namespace is its name; the fixture has the engine kubelet run the tiny model there
        self.tenant_a, self.ns_a = tenants.create("gw-a", quota, gateway={"apiKeySecrets": [{"name": "a-keys"}]})
        self.tenant_b, self.ns_b = tenants.create("gw-b", quota, gateway={"apiKeySecrets": [{"name": "b-keys"}]})
        for ns, replicas in ((self.ns_a, 2), (self.ns_b, 1)):
            kube.apply(model_deployment("chat", ns, flavors["h200"], replicas=replicas))
        for ns, replicas in ((self.ns_a, 2), (self.ns_b, 1)):
            wait_for(f"{ns}/chat ready", lambda ns=ns, n=replicas: ((kube.get(API, "modeldeployments", "chat", ns)
                                                                     or {}).get("status") or {}).get("readyReplicas")
                     == n, timeout=300)

    def write_keys(self, name: str, keys: dict[str, str]) -> None:
        """The Secret `name` in the key namespace holds exactly `keys` (created or replaced)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                     stdin=json.dumps(secret(self.keys_ns, name, keys)))

    def engines(self, ns: str) -> list[dict[str, Any]]:
        return [e for e in engines(self.cluster, ns) if e.get("ready")]

    def engine_metric(self, ns: str, name: str, **labels: str) -> float:
        total = 0.0
        for e in self.engines(ns):
            text = httpx.get(f"http://{e['ip']}:{e['port']}/metrics", timeout=5, trust_env=False).text
            total += metric_sum(text, name, **labels)
        return total


@pytest.fixture(scope="module")
def keys_namespace(kube: Kube) -> Iterator[str]:
    ns = f"gw-keys-{uuid.uuid4().hex[:5]}"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    kube.delete("v1", "namespaces", ns)


@pytest.fixture
def setup(kube: Kube, kubectl: Callable[..., Any], tenants: Any, flavors: dict[str, str], cluster: Any,
          keys_namespace: str) -> Setup:
    return Setup(kube, kubectl, tenants, flavors, cluster, keys_namespace)


@pytest.fixture
def gateway(setup: Setup, kubeconfig: str, cluster: Any, request: pytest.FixtureRequest) -> Iterator[GatewayProcess]:
    log = Path(cluster.logs) / f"gateway-{request.node.name}.log"
    gw = GatewayProcess(log, kubeconfig=kubeconfig, args=["--keys-namespace", setup.keys_ns, "--scrape-interval",
                                                           "0.5"]).start()
    wait_for("the gateway sees both models' replicas",
             lambda: gw.metric("kvfleet_gateway_ready_replicas", namespace=setup.ns_a) == 2
             and gw.metric("kvfleet_gateway_ready_replicas", namespace=setup.ns_b) == 1, timeout=60)
    yield gw
    gw.stop()


def client(gw: GatewayProcess, key: str) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120,
                  http_client=httpx.Client(trust_env=False))


def test_tenants_keys_and_models(setup: Setup, gateway: GatewayProcess) -> None:
    a, b = client(gateway, setup.key_a), client(gateway, setup.key_b)
    with pytest.raises(openai.AuthenticationError):
        client(gateway, new_key("nobody")).models.list()
    assert httpx.get(gateway.url + "/v1/models", trust_env=False).status_code == 401
    # the same name in two tenants: each key sees and reaches its own
    assert [(m.id, m.owned_by) for m in a.models.list().data] == [("chat", setup.tenant_a)]
    assert [(m.id, m.owned_by) for m in b.models.list().data] == [("chat", setup.tenant_b)]
    served_a = setup.engine_metric(setup.ns_a, "kvfleet:request_success_total")
    served_b = setup.engine_metric(setup.ns_b, "kvfleet:request_success_total")
    raw = a.chat.completions.with_raw_response.create(model="chat", messages=MSG, max_tokens=4)
    assert raw.headers["x-kvfleet-replica"].startswith(setup.ns_a + "/chat-")
    b.chat.completions.create(model="chat", messages=MSG, max_tokens=4)
    b.chat.completions.create(model="chat", messages=MSG, max_tokens=4)
    assert setup.engine_metric(setup.ns_a, "kvfleet:request_success_total") - served_a == 1
    assert setup.engine_metric(setup.ns_b, "kvfleet:request_success_total") - served_b == 2
    with pytest.raises(openai.NotFoundError) as err:
        b.chat.completions.create(model=f"{setup.ns_a}/chat", messages=MSG, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    # rotation: a new entry works and a deleted one stops, no restart
    rotated = new_key("team-a")
    setup.write_keys("a-keys", {"k1": setup.key_a, "k2": rotated})
    wait_for("the new key", lambda: httpx.get(gateway.url + "/v1/models", trust_env=False, headers={
        "Authorization": f"Bearer {rotated}"}).status_code == 200, timeout=30)
    setup.write_keys("a-keys", {"k2": rotated})
    wait_for("the old key refused", lambda: httpx.get(gateway.url + "/v1/models", trust_env=False, headers={
        "Authorization": f"Bearer {setup.key_a}"}).status_code == 401, timeout=30)
    assert gateway.metric("kvfleet_gateway_completion_tokens_total", namespace=setup.ns_b) == 8
    assert setup.key_a not in gateway.log_tail(1000) and rotated not in gateway.log_tail(1000)


def test_structured_outputs_reach_the_engine_and_its_errors_come_back(setup: Setup, gateway: GatewayProcess) -> None:
    """A tenant's constrained request through the gateway to a real engine pod: the answer matches its regex, a
    JSON schema the engine cannot compile is the engine's 400 naming the field, passed through, and a named tool
    call comes back with arguments of its schema."""
    b = client(gateway, setup.key_b)
    got = b.chat.completions.create(model="chat", messages=MSG, max_tokens=12, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", got.choices[0].message.content or ""), got
    assert got.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        b.chat.completions.create(model="chat", messages=MSG, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert err.value.param == "response_format"
    assert err.value.body["message"].startswith("response_format.json_schema.schema: "), err.value.body
    # a named tool call: its arguments are a structured output of the function's schema
    tool: Any = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
        "additionalProperties": False}}}
    called = b.chat.completions.create(model="chat", messages=MSG, max_tokens=16, temperature=0, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "pick"}})
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "pick" and json.loads(call.function.arguments)["color"] in ("red", "blue")


def test_the_responses_api_reaches_the_engine_and_its_tokens_count(setup: Setup, gateway: GatewayProcess) -> None:
    """A tenant's `client.responses.create` through the gateway to a real engine pod: the answer is the chat
    endpoint's for the same conversation, streamed as numbered events ending with the whole response, and the
    gateway counts its tokens from the response's usage (the stream's from its last event)."""
    b = client(gateway, setup.key_b)
    before = gateway.metric("kvfleet_gateway_completion_tokens_total", namespace=setup.ns_b)
    got = b.responses.create(model="chat", input=MSG, max_output_tokens=6, temperature=0)
    chat = b.chat.completions.create(model="chat", messages=MSG, max_tokens=6, temperature=0)
    assert got.output_text == chat.choices[0].message.content and got.usage is not None
    events = list(b.responses.create(model="chat", input=MSG, max_output_tokens=6, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete") and last.response.usage is not None
    counted = got.usage.output_tokens + (chat.usage.completion_tokens if chat.usage else 0) + \
        last.response.usage.output_tokens
    wait_for("the gateway counts the three answers' tokens", lambda: gateway.metric(
        "kvfleet_gateway_completion_tokens_total", namespace=setup.ns_b) - before == counted, timeout=10)


def test_a_client_that_leaves_aborts_the_engine_request(setup: Setup, gateway: GatewayProcess) -> None:
    before = setup.engine_metric(setup.ns_a, "kvfleet:request_success_total", finished_reason="abort")
    stream = client(gateway, setup.key_a).completions.create(model="chat", prompt="once upon a time", stream=True,
                                                             **LONG)
    next(iter(stream))
    stream.close()
    wait_for("the engine aborting the request", lambda: setup.engine_metric(
        setup.ns_a, "kvfleet:request_success_total", finished_reason="abort") == before + 1
        and setup.engine_metric(setup.ns_a, "kvfleet:num_requests_running") == 0, timeout=30)


def kill_engine(row: dict[str, Any]) -> None:
    os.kill(int(row["pid"]), signal.SIGKILL)


def test_a_dead_replica_is_retried_on_another(setup: Setup, gateway: GatewayProcess) -> None:
    a = client(gateway, setup.key_a)
    # idle replicas tie on load and short prompts go to the first by name: kill that one's engine
    first = min(setup.engines(setup.ns_a), key=lambda e: e["pod"])
    kill_engine(first)
    for i in range(4):  # before the engine kubelet notices, its pod is still Ready
        assert a.completions.create(model="chat", prompt=f"q{i}", max_tokens=2).choices[0].finish_reason
    assert gateway.metric("kvfleet_gateway_upstream_retries_total", namespace=setup.ns_a) >= 1
    assert gateway.metric("kvfleet_gateway_requests_total", namespace=setup.ns_a, code="200") == 4


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(setup: Setup, gateway: GatewayProcess) -> None:
    stream = client(gateway, setup.key_a).completions.create(model="chat", prompt="once upon a time", stream=True,
                                                             **LONG)
    events = iter(stream)
    next(events)
    serving = wait_for("the serving engine", lambda: next((
        e for e in setup.engines(setup.ns_a)
        if metric_sum(httpx.get(f"http://{e['ip']}:{e['port']}/metrics", trust_env=False).text,
                      "kvfleet:num_requests_running") >= 1), None), timeout=30)
    kill_engine(serving)
    with pytest.raises(openai.APIError) as err:
        for _ in events:
            pass
    assert "failed before it ended" in str(err.value)
    assert gateway.metric("kvfleet_gateway_request_errors_total", reason="upstream_disconnected") == 1
