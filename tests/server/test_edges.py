"""The edges of a real `kvfleet serve`, probed as an attacker would: idle, slow and half-sent
connections over raw loopback sockets, too many connections, broken HTTP framing, texts far longer
than the context.

One server with short bounds (keep-alive 3 s, headers 2 s, body 2 s, at most 16 connections), a
long context (131072 tokens: a megabyte of text is worth tokenizing) and its metrics on a port of
their own. Each test waits for the server to act (bounded), and checks it acted neither late nor early.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import httpx
import pytest

from server_proc import Server, free_port, start_server

KEEP_ALIVE_S, HEADERS_S, BODY_S, MAX_CONNECTIONS = 3.0, 2.0, 2.0, 16
SLACK_S = 15.0   # how late the server may act on a busy machine; early is always a failure
CONTEXT = 131072
CHARS_PER_TOKEN = 13   # the longest entry of the test tokenizer's vocabulary: `<|endoftext|>`


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def server(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model_factory("llama", max_position_embeddings=CONTEXT)
    srv = start_server(model, tmp_path_factory.mktemp("edge-logs"), "--max-model-len", str(CONTEXT),
                       "--metrics-port", str(METRICS_PORT),
                       "--timeout-keep-alive", str(KEEP_ALIVE_S), "--timeout-request-headers", str(HEADERS_S),
                       "--timeout-request-body", str(BODY_S), "--max-connections", str(MAX_CONNECTIONS))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log.read_text(errors="replace"), srv.log_tail()


def connect(server: Server) -> socket.socket:
    url = urlparse(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def read_until_closed(sock: socket.socket, opened: float, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds from `opened`
    until it did; fails if it is still open `limit_s` after `opened`."""
    chunks = []
    while True:
        left = opened + limit_s - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the server kept the connection open for more than {limit_s} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - opened


def error_response(raw: bytes, status: int) -> dict[str, Any]:
    """The OpenAI-shaped error of a raw HTTP response with `status`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def test_idle_connections_are_closed_after_the_keep_alive(server: Server) -> None:
    """Connections that never send a byte (100 of them, over the connection cap) are all closed once
    idle for --timeout-keep-alive, and the server serves normally meanwhile and after."""
    socks = [(connect(server), time.monotonic()) for _ in range(100)]
    try:
        for sock, opened in socks:
            data, took = read_until_closed(sock, opened, KEEP_ALIVE_S + SLACK_S)
            assert data == b"" and took >= KEEP_ALIVE_S * 0.9, (data, took)
    finally:
        for sock, _ in socks:
            sock.close()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_a_kept_alive_connection_is_closed_once_idle(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answered = time.monotonic()
        data, took = read_until_closed(sock, answered, KEEP_ALIVE_S + SLACK_S)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b'{"status":"ok"}'), data
    assert took >= KEEP_ALIVE_S * 0.9, took


@pytest.mark.parametrize("sent", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",      # headers cut short
    b"GET /hea",                                                            # even the request line
])
def test_half_sent_headers_get_408_within_the_bound(server: Server, sent: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(sent)
        data, took = read_until_closed(sock, time.monotonic(), HEADERS_S + SLACK_S)
    err = error_response(data, 408)
    assert err["code"] == "request_timeout" and "--timeout-request-headers" in err["message"], err
    assert took >= HEADERS_S * 0.9, took


def test_headers_sent_a_byte_at_a_time_get_no_more_time(server: Server) -> None:
    """The header deadline is total: a client that keeps dribbling bytes is closed on time too."""
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
    with connect(server) as sock:
        opened = time.monotonic()
        stop = threading.Event()

        def dribble() -> None:
            for byte in request:
                if stop.wait(0.1):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return

        sender = threading.Thread(target=dribble, daemon=True)
        sender.start()
        try:
            data, took = read_until_closed(sock, opened, HEADERS_S + SLACK_S)
        finally:
            stop.set()
            sender.join(5)
    assert error_response(data, 408)["code"] == "request_timeout"
    assert took >= HEADERS_S * 0.9, took


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/health"])
def test_a_body_shorter_than_its_content_length_gets_408(server: Server, path: str) -> None:
    """Whether the route reads its body or not, the connection cannot wait for ever for the rest."""
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            .encode())
    with connect(server) as sock:
        sock.sendall(head + b'{"prompt": "x"')
        data, took = read_until_closed(sock, time.monotonic(), BODY_S + SLACK_S)
    if path == "/health":   # GET only: answered (405) at once, then the missing body is waited for
        assert data.startswith(b"HTTP/1.1 405 "), data
    else:
        err = error_response(data, 408)
        assert err["code"] == "request_timeout" and "--timeout-request-body" in err["message"], err
    assert took >= BODY_S * 0.9, took


@pytest.mark.parametrize("header", [b"Content-Length: -1", b"Content-Length: abc", b"Bad Header Line"])
def test_broken_framing_gets_an_openai_shaped_400(server: Server, header: bytes) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n{}")
        data, _ = read_until_closed(sock, time.monotonic(), SLACK_S)
    assert error_response(data, 400)["code"] == "invalid_http_request"


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_connections_past_the_cap_get_503_then_room_comes_back(server: Server) -> None:
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(server) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, _ = read_until_closed(extra, time.monotonic(), SLACK_S)
        # Meaningful only if the held connections were all open when the extra one came.
        assert all(still_open(sock) for sock in held), "the held connections closed too soon to test the cap"
        err = error_response(data, 503)
        assert err["code"] == "too_many_connections" and str(MAX_CONNECTIONS) in err["message"], err
        assert b"retry-after: 1" in data.lower()
    finally:
        for sock in held:
            sock.close()

    def serves() -> bool:
        return httpx.get(server.url + "/health", timeout=10).status_code == 200

    wait_until(serves, SLACK_S, "the server to accept requests again once the held connections closed")


def post(server: Server, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


LIMIT = CONTEXT * CHARS_PER_TOKEN   # characters


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x" * (LIMIT + 1)}),
    ("/v1/completions", {"prompt": ["hello", "y" * (LIMIT + 1)]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z " * (LIMIT // 2 + 1)}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (30 * 2**20)}]}),  # 30 MiB
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "b" * (LIMIT // 2)},
                                           {"role": "user", "content": [{"type": "text", "text": "c" * LIMIT}]}]}),
    ("/tokenize", {"prompt": "d" * (LIMIT + 1)}),
    ("/tokenize", {"messages": [{"role": "user", "content": "e" * (LIMIT + 1)}]}),
])
def test_text_that_cannot_fit_is_refused_before_tokenizing(server: Server, path: str, body: dict[str, Any]) -> None:
    """More characters than CONTEXT tokens can hold (13 characters a token at most, with this
    tokenizer): a 400 naming the field and the bound, without spending seconds of CPU on it."""
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    field = "messages" if "messages" in body else "prompt"
    assert err["param"] == field and f"at most {LIMIT} characters" in err["message"], err


def test_token_ids_over_the_context_are_refused_by_their_count(server: Server) -> None:
    resp = post(server, "/v1/completions", {"prompt": [7] * (CONTEXT + 1), "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]
    assert f"{CONTEXT + 1} tokens" in resp.json()["error"]["message"]
    resp = post(server, "/v1/completions", {"prompt": [[1, 2], [7] * CONTEXT], "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt", resp.text[:300]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["once upon a time " * 70_000] * 3, "max_tokens": 1}),   # 3 x 1.2 MB
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "once upon a time " * 70_000}],
                              "max_tokens": 1}),
])
def test_long_texts_that_may_fit_are_tokenized_off_the_event_loop(server: Server, path: str,
                                                                  body: dict[str, Any]) -> None:
    """Texts under the character bound are tokenized (seconds for megabytes: here they turn out over the
    context, ~4 characters a token); meanwhile /health (the liveness probe) and /metrics (the
    autoscaler's scrape) keep answering at once."""
    box: dict[str, Any] = {}
    # The client's own work is done before the clock starts and kept off the probes' thread: the body is encoded
    # here (json.dumps of megabytes holds this process's GIL), and each side has one client (a new one costs
    # ~30 ms of CPU for its TLS context), so a slow probe is the server's doing, not this process's.
    data = json.dumps(body).encode()
    with httpx.Client(timeout=120, trust_env=False) as sender, httpx.Client(timeout=30, trust_env=False) as prober:

        def send() -> None:
            start = time.monotonic()
            box["resp"] = sender.post(server.url + path, content=data, headers={"Content-Type": "application/json"})
            box["took"] = time.monotonic() - start

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        slowest, probes = 0.0, 0
        while thread.is_alive():
            for probe in (server.url + "/health", f"http://127.0.0.1:{METRICS_PORT}/metrics"):
                start = time.monotonic()
                assert prober.get(probe).status_code == 200
                slowest = max(slowest, time.monotonic() - start)
                probes += 1
            time.sleep(0.05)
        thread.join()
    resp = box["resp"]
    assert resp.status_code == 400 and "maximum context length" in resp.text, resp.text[:300]
    assert "characters" not in resp.json()["error"]["message"]   # tokenized, then counted: not the early bound
    texts = len(body["prompt"]) if "prompt" in body else 1
    per_text = box["took"] / texts
    # The request was in flight for at least three rounds of probes, tokenizing most of that time (this CPU takes
    # ~0.7 s a text, a busy one several; a machine several times faster still leaves three rounds of ~60 ms) ...
    assert probes >= 6, box
    # ... and no probe waited for a text: on the event loop, one would have stalled for most of one
    # (the margin is for a machine whose CPUs are busy with other work: probes slow down, not stall).
    assert slowest < per_text / 2, (slowest, per_text)


def test_metrics_on_their_own_port_only(server: Server) -> None:
    """With --metrics-port, the API port does not show the metrics (they name tenants), and the metrics
    port shows nothing else."""
    metrics_url = f"http://127.0.0.1:{METRICS_PORT}"
    resp = httpx.get(server.url + "/metrics", timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    resp = httpx.get(metrics_url + "/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'kvfleet:num_requests_waiting{model_name="tiny"}' in resp.text
    for path in ("/health", "/v1/models", "/openapi.json"):
        assert httpx.get(metrics_url + path, timeout=30).status_code == 404, path
        assert httpx.get(server.url + path, timeout=30).status_code == 200, path


def test_long_detokenize_is_checked_and_decoded_off_the_event_loop(server: Server) -> None:
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "once upon a time " * 20_000}, timeout=60).json()
    resp = post(server, "/detokenize", {"tokens": tokens["tokens"]})
    assert resp.status_code == 200 and resp.json()["prompt"] == "once upon a time " * 20_000
    resp = post(server, "/detokenize", {"tokens": tokens["tokens"] + [10**6]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens", resp.text[:300]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def test_sigterm_while_tokenizing_answers_503_and_exits(server: Server) -> None:
    """Last in the module: it stops the server. A request still tokenizing when the server shuts down
    (not yet an engine request, so not one the drain waits for) gets an OpenAI-shaped 503, not a
    traceback and a plain-text 500; the process exits 0."""
    box: dict[str, Any] = {}
    # ~28 MB of prompts (under the 32 MiB body limit): seconds of tokenizing after the signal, longer than the drain
    # and the 1 s uvicorn then gives open requests, even on an idle machine (there 5 prompts got their 400 first)
    body = {"prompt": ["once upon a time " * 70_000] * 24, "max_tokens": 1}
    busy_before = cpu_seconds(server.proc.pid)
    thread = threading.Thread(target=lambda: box.update(resp=post(server, "/v1/completions", body)), daemon=True)
    thread.start()
    wait_until(lambda: cpu_seconds(server.proc.pid) - busy_before > 1.0, 60, "the server to be tokenizing")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    thread.join(30)
    resp = box["resp"]
    # Cut while tokenizing; or, on a fast machine, refused as the drain's new engine request would be.
    assert resp.status_code == 503 and resp.json()["error"]["code"] in ("server_shutdown", "draining"), resp.text[:300]
    assert resp.headers["Retry-After"] == "1"
