"""The edges of a real `kvfleet serve`, probed as an attacker would over raw loopback sockets: idle,
slow and half-sent connections, too many connections, broken HTTP framing.

One server with short bounds (keep-alive 3 s, headers 2 s, body 2 s, at most 16 connections).
Each test waits for the server to act (bounded), and checks it acted neither late nor early.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import httpx
import pytest

from server_proc import Server, start_server

KEEP_ALIVE_S, HEADERS_S, BODY_S, MAX_CONNECTIONS = 3.0, 2.0, 2.0, 16
SLACK_S = 15.0   # how late the server may act on a busy machine; early is always a failure


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("edge-logs"),
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
