"""The gateway in front of real `kvfleet serve` engines (CPU, a tiny model), driven by the `openai` client.

The gateway reads a static config (no cluster): the request path is the same as in one (see
e2e/test_gateway.py for it on the local cluster, replicas discovered from the API server).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from kvfleet.gateway.testing import Engine, GatewayProcess, start_engines, wait_until

from gw_helpers import KEY_A, KEY_B, write_config

pytestmark = pytest.mark.timeout(300)

LONG = {"max_tokens": 600, "min_tokens": 600, "ignore_eos": True}
LONG_SDK = {"max_tokens": 600, "extra_body": {"min_tokens": 600, "ignore_eos": True}}
MSG = [{"role": "user", "content": "Say something."}]


def client(gw: GatewayProcess, key: str = KEY_A) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def gateway(tmp: Path, engines: list[Engine], *args: str, team_b: list[Engine] | None = None) -> GatewayProcess:
    tenants: dict[str, Any] = {"team-a": {"keys": [KEY_A], "models": {"tiny": {"replicas": [e.url for e in engines]}}}}
    if team_b is not None:
        tenants["team-b"] = {"keys": [KEY_B], "models": {"tiny": {"replicas": [e.url for e in team_b]}}}
    config = write_config(tmp / "gateway.yaml", tenants)
    return GatewayProcess(tmp / "gateway.log", config=config, args=["--scrape-interval", "0.2", *args]).start()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess,
                                                                                           list[Engine]]]:
    """Two engines (context 1024) for team-a's `tiny`, the second also team-b's `tiny`; the gateway."""
    tmp = tmp_path_factory.mktemp("gw-fleet")
    engines = start_engines(tiny_model_dir, tmp, 2, "--max-model-len", "1024")
    gw = gateway(tmp, engines, "--max-request-bytes", "200000", team_b=engines[1:])
    yield gw, engines
    gw.stop()
    for e in engines:
        e.stop()


def test_answers_through_the_gateway_equal_the_engines_own(fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = fleet
    direct = OpenAI(base_url=engines[0].url + "/v1", api_key="unused", max_retries=0)
    via = client(gw)
    kwargs = {"model": "tiny", "messages": MSG, "max_tokens": 12, "temperature": 0}
    want = direct.chat.completions.create(**kwargs)
    got = via.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage == want.usage
    streamed = "".join(c.choices[0].delta.content or "" for c in via.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == want.choices[0].message.content
    raw = via.chat.completions.with_raw_response.create(**kwargs)
    assert raw.headers["x-kvfleet-replica"] in {e.url for e in engines}  # static replicas are named by URL
    text = via.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0)
    assert text.choices[0].text == direct.completions.create(model="tiny", prompt="hello", max_tokens=5,
                                                             temperature=0).choices[0].text
    assert gw.metric("kvfleet_gateway_completion_tokens_total", tenant="team-a", model="tiny") >= 29


RESPONSES_BAD = [
    {"model": "tiny", "input": []},
    {"model": "tiny", "input": "x", "stream_options": {"include_usage": True}},
    {"model": "tiny", "input": "x", "max_output_tokens": 0},
    {"model": "tiny", "input": "x", "previous_response_id": "resp_1"},
    {"model": "tiny", "input": [{"type": "item_reference", "id": "msg_1"}]},
]


def test_responses_through_the_gateway_equal_the_engines_own(fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    """OpenAI's Responses API: the answer, its stream (whose last event's usage the gateway counts) and the 400s."""
    gw, engines = fleet
    direct = OpenAI(base_url=engines[0].url + "/v1", api_key="unused", max_retries=0)
    via = client(gw)
    kwargs: Any = {"model": "tiny", "instructions": "Be brief.", "input": "Say something.", "max_output_tokens": 12,
                   "temperature": 0}
    want = direct.responses.create(**kwargs)
    got = via.responses.create(**kwargs)
    assert (got.status, got.output_text) == (want.status, want.output_text)
    assert got.usage is not None and want.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (want.usage.input_tokens, want.usage.output_tokens)
    before = gw.metric("kvfleet_gateway_completion_tokens_total", tenant="team-a", model="tiny")
    events = list(via.responses.create(**kwargs, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    last = events[-1]
    assert last.type == f"response.{want.status}" and last.response.usage is not None
    assert last.response.usage.output_tokens == want.usage.output_tokens
    wait_until("the stream's usage counted", lambda: gw.metric("kvfleet_gateway_completion_tokens_total",
                                                              tenant="team-a", model="tiny") - before
               == want.usage.output_tokens, timeout=10)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    for body in RESPONSES_BAD:
        mine = httpx.post(gw.url + "/v1/responses", json=body, headers=auth)
        theirs = httpx.post(engines[0].url + "/v1/responses", json=body)
        assert (mine.status_code, mine.json()) == (400, theirs.json()), body


def test_tokenize_and_detokenize_reach_the_models_replicas(fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = fleet
    auth = {"Authorization": f"Bearer {KEY_A}"}
    ok = gw.metric("kvfleet_gateway_requests_total", tenant="team-a", model="tiny", code="200")
    for path, body in (("/tokenize", {"model": "tiny", "prompt": "hello world"}),
                       ("/tokenize", {"model": "tiny", "messages": MSG}),
                       ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7]})):
        mine = httpx.post(gw.url + path, json=body, headers=auth)
        theirs = httpx.post(engines[0].url + path, json=body)
        assert (mine.status_code, mine.json()) == (200, theirs.json()), body
        assert mine.headers["x-kvfleet-replica"] in {e.url for e in engines}
    assert gw.metric("kvfleet_gateway_requests_total", tenant="team-a", model="tiny", code="200") == ok + 3
    # the gateway's checks (key, model, body) and the engine's (the vocabulary), in the engine's shapes
    assert httpx.post(gw.url + "/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401
    missing = httpx.post(gw.url + "/tokenize", json={"model": "nope", "prompt": "x"}, headers=auth)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    both = {"model": "tiny", "prompt": "x", "messages": MSG}
    mine = httpx.post(gw.url + "/tokenize", json=both, headers=auth)
    assert (mine.status_code, mine.json()) == (400, httpx.post(engines[0].url + "/tokenize", json=both).json())
    out_of_vocab = {"model": "tiny", "tokens": [10**9]}
    mine = httpx.post(gw.url + "/detokenize", json=out_of_vocab, headers=auth)
    theirs = httpx.post(engines[0].url + "/detokenize", json=out_of_vocab)
    assert (mine.status_code, mine.json()) == (400, theirs.json())
    assert httpx.get(gw.url + "/tokenize", headers=auth).status_code == 405


def test_tenants_see_and_reach_only_their_own_models(fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, _ = fleet
    assert [m.id for m in client(gw, KEY_A).models.list().data] == ["tiny"]
    assert [m.owned_by for m in client(gw, KEY_B).models.list().data] == ["team-b"]
    with pytest.raises(openai.AuthenticationError) as err:
        client(gw, "not-a-key-0000000000").models.list()
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as nf:
        client(gw, KEY_B).chat.completions.create(model="team-a/tiny", messages=MSG, max_tokens=2)
    assert nf.value.body["code"] == "model_not_found" and nf.value.body["param"] == "model"
    no_key = httpx.post(gw.url + "/v1/chat/completions", json={"model": "tiny", "messages": MSG})
    assert no_key.status_code == 401 and no_key.headers["WWW-Authenticate"] == "Bearer"


BAD_BODIES = [
    {"model": "tiny", "messages": []},
    {"model": "tiny", "messages": MSG, "temperature": -1},
    {"model": "tiny", "messages": MSG, "n": "2"},
    {"model": "tiny", "messages": MSG, "max_tokens": 0},
    {"model": "tiny", "messages": MSG, "stream_options": {"include_usage": True}},
    {"model": "tiny", "messages": MSG, "top_logprobs": 2},
    {"model": "tiny", "messages": MSG, "unknown_field": 1},
    {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
    [1, 2, 3],
]


def test_bad_input_is_refused_before_any_upstream_call_in_the_engines_shapes(
        fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = fleet
    auth = {"Authorization": f"Bearer {KEY_A}"}
    routed = gw.metric("kvfleet_gateway_routing_decisions_total")
    for body in BAD_BODIES:
        mine = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth)
        theirs = httpx.post(engines[0].url + "/v1/chat/completions", json=body)
        assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json()) == (400, theirs.json()), body
    for raw in (b"{oops", b""):
        mine = httpx.post(gw.url + "/v1/chat/completions", content=raw, headers=auth)
        assert mine.status_code == 400 and mine.json()["error"]["code"] in ("invalid_json", "missing_body")
    big = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": "tiny", "prompt": "x" * 300_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert gw.metric("kvfleet_gateway_routing_decisions_total") == routed  # nothing went upstream
    # what only the engine can check (the context length) is its own 400, passed through
    long = httpx.post(gw.url + "/v1/completions", headers=auth, json={"model": "tiny", "prompt": "hello " * 2000})
    direct = httpx.post(engines[0].url + "/v1/completions", json={"model": "tiny", "prompt": "hello " * 2000})
    assert (long.status_code, long.json()) == (400, direct.json())
    assert httpx.get(gw.url + "/v1/embeddings", headers=auth).json()["error"]["code"] == "not_found"
    assert httpx.get(gw.url + "/v1/chat/completions", headers=auth).status_code == 405


def aborted(engines: list[Engine]) -> float:
    return sum(e.metric("kvfleet:request_success_total", finished_reason="abort") for e in engines)


def running(engines: list[Engine]) -> float:
    return sum(e.metric("kvfleet:num_requests_running") for e in engines)


def test_a_client_that_leaves_aborts_the_upstream_request(fleet: tuple[GatewayProcess, list[Engine]],
                                                          held_post: Any) -> None:
    gw, engines = fleet
    before = aborted(engines)
    gone = gw.metric("kvfleet_gateway_request_errors_total", reason="client_disconnected")
    stream = client(gw).completions.create(model="tiny", prompt="once upon a time", stream=True, **LONG_SDK)
    next(iter(stream))
    wait_until("the request running", lambda: running(engines) >= 1, timeout=30)
    stream.close()
    wait_until("the engine aborting it", lambda: aborted(engines) >= before + 1 and running(engines) == 0,
               timeout=20)
    # a non-streamed request given up by its client is aborted too: the client closes its connection once the
    # engine runs the request (a client-side timeout would race the engine's speed on a fast machine)
    longest = {"max_tokens": 1000, "min_tokens": 1000, "ignore_eos": True}   # near the engines' 1024 tokens
    with held_post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "hi", **longest},
                   {"Authorization": f"Bearer {KEY_A}"}):
        wait_until("the request running", lambda: running(engines) >= 1, timeout=30)
    wait_until("the engine aborting it", lambda: aborted(engines) >= before + 2 and running(engines) == 0,
               timeout=20)
    assert gw.metric("kvfleet_gateway_request_errors_total", reason="client_disconnected") - gone == 2


def test_requests_sharing_a_long_prefix_land_on_the_replica_that_has_it(
        fleet: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = fleet
    system = "You are the ACME support assistant. " * 30  # ~1100 characters: 4 prefix blocks
    count = [e.metric("kvfleet:request_success_total") for e in engines]
    hits = [e.metric("kvfleet:prefix_cache_hits_total") for e in engines]
    c = client(gw)
    for q in ("Where is my order?", "How do I reset my password?", "Can I pay by card?", "Hello?"):
        c.chat.completions.create(model="tiny", messages=[{"role": "system", "content": system},
                                                          {"role": "user", "content": q}], max_tokens=2)
    served = [e.metric("kvfleet:request_success_total") - n for e, n in zip(engines, count, strict=True)]
    assert sorted(served) == [0, 4]
    home = served.index(4)
    assert engines[home].metric("kvfleet:prefix_cache_hits_total") - hits[home] > 0
    assert gw.metric("kvfleet_gateway_routing_decisions_total", rule="prefix") >= 3


# -- replicas that fail (each test has its own engines) ---------------------------------------------------------

@pytest.fixture
def pair(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[GatewayProcess, list[Engine]]]:
    engines = start_engines(tiny_model_dir, tmp_path, 2, "--shutdown-grace-period", "60")
    gw = gateway(tmp_path, engines)
    yield gw, engines
    gw.stop()
    for e in engines:
        e.kill()


def test_a_dead_replica_is_retried_on_another(pair: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = pair
    min(engines, key=lambda e: e.url).kill()  # short prompts on idle replicas go to the first by name: that one
    c = client(gw)
    for i in range(6):
        reply = c.completions.create(model="tiny", prompt=f"request {i}", max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
    assert gw.metric("kvfleet_gateway_upstream_retries_total") >= 1
    assert gw.metric("kvfleet_gateway_requests_total", code="200") >= 6


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error(pair: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = pair
    stream = client(gw).completions.create(model="tiny", prompt="once upon a time", stream=True, **LONG_SDK)
    events = iter(stream)
    next(events)
    serving = wait_until("the serving replica", lambda: next((e for e in engines
                                                              if e.metric("kvfleet:num_requests_running") >= 1), None),
                         timeout=30)
    serving.kill()
    start = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in events:
            pass
    assert time.monotonic() - start < 10
    assert "failed before it ended" in str(err.value)
    assert gw.metric("kvfleet_gateway_request_errors_total", reason="upstream_disconnected") == 1


def test_a_draining_replica_gets_no_new_requests(pair: tuple[GatewayProcess, list[Engine]]) -> None:
    gw, engines = pair
    # a long request keeps the first engine draining (grace 60 s) after SIGTERM; the fixture kills it after
    def long_request() -> None:
        try:
            httpx.post(engines[0].url + "/v1/completions", timeout=120, json={"model": "tiny", "prompt": "hi", **LONG})
        except httpx.HTTPError:
            pass

    threading.Thread(target=long_request, daemon=True).start()
    wait_until("a request on the first engine", lambda: engines[0].metric("kvfleet:num_requests_running") >= 1,
               timeout=30)
    engines[0].proc.terminate()
    wait_until("the first engine draining", lambda: httpx.get(engines[0].url + "/health").status_code == 503,
               timeout=10)
    c = client(gw)
    before = engines[1].metric("kvfleet:request_success_total")
    for i in range(6):
        assert c.completions.create(model="tiny", prompt=f"q{i}", max_tokens=2).choices[0].text is not None
    assert engines[1].metric("kvfleet:request_success_total") - before == 6
    assert engines[0].metric("kvfleet:request_rejected_total", reason="draining") <= 1  # one try, then never again
