"""Overload and faults on a real `kvfleet serve`: queue depth, 429, client disconnects, SIGTERM drain.

One server for most of the module, one sequence at a time (`--max-num-seqs 1`) so requests really
queue; its SIGTERM test ends it. A second one (one API key, a chat template file, a 1 s grace period)
checks what happens to work still running when the grace period ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from server_proc import Server, start_server

LONG = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("fault-logs"), "--max-num-seqs", "1",
                       "--max-queue-len", "4", "--shutdown-grace-period", "120", "--max-request-bytes", "65536")
    yield srv
    srv.stop()


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def burst(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True}
            return list(await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(n)]))

    return asyncio.run(run())


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


@contextlib.contextmanager
def slot_held(server: Server) -> Iterator[None]:
    """A long stream in the server's only sequence slot while the block runs: what is sent meanwhile queues behind
    it for its 1,000 tokens (seconds, where sampling a short burst saw the queue for a scrape or two, or not at all,
    on a loaded machine). Leaving closes the stream, which aborts it."""
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(LONG, stream=True), timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept: a line iterator dropped here would close the stream, and abort it
        next(line for line in lines if line.startswith("data: "))  # it runs
        yield


def test_queue_depth_rises_during_burst_and_returns_to_zero(server: Server) -> None:
    done_before = server.metric("kvfleet:request_success_total", finished_reason="length")
    with slot_held(server):
        thread, box = in_thread(lambda: burst(server.url, 3, 40))
        wait_until(lambda: server.metric("kvfleet:num_requests_waiting") == 3, 30, "the burst waiting")
    thread.join(120)
    assert "error" not in box, box
    assert [r.status_code for r in box["result"]] == [200] * 3
    wait_until(lambda: server.metric("kvfleet:num_requests_waiting") == 0
               and server.metric("kvfleet:num_requests_running") == 0, 10, "the gauges back at zero")
    assert server.metric("kvfleet:request_success_total", finished_reason="length") - done_before == 3


def test_queue_full_gets_429_with_retry_after(server: Server) -> None:
    """One running, four waiting (`--max-queue-len 4`): the other six of ten are refused at once."""
    rejected_before = server.metric("kvfleet:request_rejected_total", reason="queue_full")
    with slot_held(server):
        thread, box = in_thread(lambda: burst(server.url, 10, 30))
        wait_until(lambda: server.metric("kvfleet:request_rejected_total", reason="queue_full") - rejected_before
                   == 6 and server.metric("kvfleet:num_requests_waiting") == 4, 30, "four waiting, six refused")
    thread.join(120)
    assert "error" not in box, box
    responses = box["result"]
    codes = [r.status_code for r in responses]
    assert sorted(codes) == [200] * 4 + [429] * 6, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert server.metric("kvfleet:request_rejected_total", reason="queue_full") - rejected_before == 6
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def busy(server: Server, idle: float) -> bool:
    return server.metric("kvfleet:num_requests_running") == 1 and server.metric("kvfleet:kv_cache_usage_perc") > idle


def back_to_idle(server: Server, idle: float) -> bool:
    return server.metric("kvfleet:num_requests_running") == 0 and server.metric("kvfleet:kv_cache_usage_perc") == idle


def test_disconnect_non_streaming_aborts_and_frees_blocks(server: Server, held_post: Callable[..., Any]) -> None:
    idle = server.metric("kvfleet:kv_cache_usage_perc")
    aborts = server.metric("kvfleet:request_success_total", finished_reason="abort")

    # the client closes its connection once the request runs (a client-side read timeout would race the engine's
    # speed: on a fast machine the 1000 tokens could be done first)
    with held_post(server.url, "/v1/completions", LONG):
        wait_until(lambda: busy(server, idle), 10, "the request to run")
    wait_until(lambda: back_to_idle(server, idle), 2, "KV blocks freed after the disconnect")
    assert server.metric("kvfleet:request_success_total", finished_reason="abort") - aborts == 1


def test_disconnect_streaming_aborts_and_frees_blocks(server: Server) -> None:
    idle = server.metric("kvfleet:kv_cache_usage_perc")
    aborts = server.metric("kvfleet:request_success_total", finished_reason="abort")
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(LONG, stream=True), timeout=60) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                assert busy(server, idle)
                break
    wait_until(lambda: back_to_idle(server, idle), 2, "KV blocks freed after the stream was closed")
    assert server.metric("kvfleet:request_success_total", finished_reason="abort") - aborts == 1


def test_disconnect_of_a_responses_stream_aborts_and_frees_blocks(server: Server) -> None:
    """/v1/responses streams the same way: a client that leaves mid-stream aborts its request."""
    idle = server.metric("kvfleet:kv_cache_usage_perc")
    aborts = server.metric("kvfleet:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "input": "once upon a time", "max_output_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as resp:
        deltas = 0
        for line in resp.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                assert busy(server, idle)
                break
    wait_until(lambda: back_to_idle(server, idle), 2, "KV blocks freed after the stream was closed")
    assert server.metric("kvfleet:request_success_total", finished_reason="abort") - aborts == 1


def test_disconnect_of_a_multi_prompt_stream_aborts_every_prompt(server: Server) -> None:
    """Two prompts in one streaming request: one runs, one waits (one sequence at a time); closing
    the stream aborts both, the waiting one included, and frees every block."""
    idle = server.metric("kvfleet:kv_cache_usage_perc")
    aborts = server.metric("kvfleet:request_success_total", finished_reason="abort")
    body = dict(LONG, prompt=["once upon a time", "the king of the city"], stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        for n, _line in enumerate(resp.iter_lines()):
            if n == 4:
                assert busy(server, idle) and server.metric("kvfleet:num_requests_waiting") == 1
                break
    wait_until(lambda: back_to_idle(server, idle) and server.metric("kvfleet:num_requests_waiting") == 0, 2,
               "both prompts aborted and their blocks freed")
    assert server.metric("kvfleet:request_success_total", finished_reason="abort") - aborts == 2


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2,
                              "stream": True}),
])
def test_engine_limits_refused_before_a_stream_starts(server: Server, path: str, body: dict[str, Any]) -> None:
    """n over --max-num-seqs is the engine's rule: a streaming request still gets a real 400, not an
    in-band error under a 200, and nothing is left queued or holding blocks."""
    idle = server.metric("kvfleet:kv_cache_usage_perc")
    resp = httpx.post(server.url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n" and "max_num_seqs=1" in resp.json()["error"]["message"]
    assert back_to_idle(server, idle) and server.metric("kvfleet:num_requests_waiting") == 0


def test_oversized_bodies_get_413_without_being_read(server: Server) -> None:
    """Over --max-request-bytes: refused from the Content-Length alone, or while a chunked body (no
    Content-Length) is read; OpenAI-style error either way, and the server goes on."""
    big = {"model": "tiny", "prompt": "x " * 40_000, "max_tokens": 1}   # ~80 kB of JSON
    r = httpx.post(f"{server.url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "65536" in err["message"]

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"y " * 4096
        yield b'", "max_tokens": 1}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200, ok.text


# Long enough to be still running when the test's next request comes (150 tokens, warmed up, took ~0.3 s
# and the server had drained and gone before it), and short enough for the grace period on a busy machine.
DRAINED_TOKENS = 600


def test_sigterm_drains_then_exits_zero(server: Server) -> None:
    body = dict(LONG, max_tokens=DRAINED_TOKENS)
    thread, box = in_thread(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=150))
    wait_until(lambda: server.metric("kvfleet:num_requests_running") == 1, 10, "the request to run")
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, 5, "/health to report draining")
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    thread.join(150)
    assert "error" not in box, box
    finished = box["result"]
    assert finished.status_code == 200 and finished.json()["choices"][0]["finish_reason"] == "length"
    assert finished.json()["usage"]["completion_tokens"] == DRAINED_TOKENS
    assert server.proc.wait(30) == 0


SOLO_KEY = "sk-solo-5555"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def short_grace(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server: one --api-key, a --chat-template file, a 1 s grace period (its last test ends it)."""
    logs = tmp_path_factory.mktemp("grace-logs")
    (logs / "template.jinja").write_text(TEMPLATE)
    srv = start_server(tiny_model_dir, logs, "--max-num-seqs", "1", "--shutdown-grace-period", "1",
                       "--api-key", SOLO_KEY, "--chat-template", str(logs / "template.jinja"))
    yield srv
    srv.stop()


def test_single_api_key_and_chat_template_file(short_grace: Server) -> None:
    from kvfleet.engine.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "hello world"}]
    assert httpx.post(short_grace.url + "/tokenize", json={"messages": messages}).status_code == 401
    resp = httpx.post(short_grace.url + "/tokenize", json={"messages": messages},
                      headers={"Authorization": f"Bearer {SOLO_KEY}"})
    assert resp.status_code == 200, resp.text
    tok = load_tokenizer(str(short_grace.proc.args[short_grace.proc.args.index("serve") + 1]))
    assert resp.json()["tokens"] == tok.encode("[user] hello world\n[assistant]", add_special_tokens=False)
    assert short_grace.metric("kvfleet:request_success_total") == 0  # tokenize is no engine request


def test_sigterm_grace_period_cuts_long_requests_and_exits_zero(short_grace: Server) -> None:
    """Work that outlives --shutdown-grace-period does not hold the pod: it is cut, and cut cleanly (an
    OpenAI-shaped 503, an error event then [DONE] in a stream: nothing ends mid-chunk), and the process
    exits 0."""
    srv = short_grace
    auth = {"Authorization": f"Bearer {SOLO_KEY}"}
    # One at a time, 8 x 1000 tokens and a stream: far more than a second of work on any machine.
    stream_thread, stream_box = in_thread(lambda: stream_lines(srv.url, auth))
    thread, box = in_thread(lambda: burst_results(srv.url, 8, 1000, auth))
    # All 9 admitted: one runs, 8 wait (the stream among them or running). Waiting alone can reach 8 with the
    # burst's requests before the stream has arrived (none scheduled yet): count the running one too.
    wait_until(lambda: srv.metric("kvfleet:num_requests_waiting") + srv.metric("kvfleet:num_requests_running") >= 9,
               20, "the burst and the stream to be admitted")
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    took = time.monotonic() - start
    thread.join(30)
    stream_thread.join(30)
    assert 1.0 <= took < 10, took
    results = box["result"]
    assert all(isinstance(r, httpx.Response) for r in results), results   # every request got an answer
    cut = [r for r in results if r.status_code != 200]
    assert len(results) == 8 and cut, results   # the rest were cut at the deadline
    for r in cut:
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", (r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "server_shutdown" and err["type"] == "service_unavailable", err
        assert "--shutdown-grace-period" in err["message"]
    assert "error" not in stream_box, stream_box
    lines = [line for line in stream_box["result"] if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "server_shutdown", lines[-3:]
    assert all(line.startswith("data: {") for line in lines[:-1]), lines   # whole events only
    log = srv.log.read_text(errors="replace")
    assert "Traceback" not in log and "Exception in ASGI application" not in log, srv.log_tail()


def stream_lines(url: str, headers: dict[str, str]) -> list[str]:
    """The SSE lines of one long streaming chat completion, however it ends."""
    body = {"messages": [{"role": "user", "content": "tell a story"}], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return list(resp.iter_lines())


def burst_results(url: str, n: int, max_tokens: int, headers: dict[str, str]) -> list[Any]:
    """Like burst(), but a request the server cut is returned as its exception."""
    async def run() -> list[Any]:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
            body = {"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True}
            return list(await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(n)],
                                             return_exceptions=True))

    return asyncio.run(run())
