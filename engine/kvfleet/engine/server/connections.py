"""HTTP/1.1 connections with bounds: uvicorn's h11 protocol, extended.

uvicorn bounds only the idle time between two requests of a kept-alive connection. A connection
that never sends a request, one that sends half its headers, or a body shorter than its
Content-Length would otherwise hold its socket (and a request task) for ever. Here every phase
of reading has a deadline, and a protocol error gets an OpenAI-shaped answer:

- idle (before the first request, between requests): `keep_alive_s`, then closed quietly;
- request headers, from their first byte to the end: `headers_s`, then 408 and closed;
- request body, from the end of the headers to its end: `body_s`, then 408 (if no response has
  started; the handler sees a disconnect) and closed;
- a request that cannot be parsed (a `Content-Length: -1`, a bad header line): 400 and closed;
- past `max_connections` open at once, a connection's request gets 503 with `Retry-After` and
  the connection is closed. Each deadline is total, not per read: a client sending one byte a
  second gets no more time than one sending none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvfleet.engine.server.errors import error_body

logger = logging.getLogger("kvfleet.server")


@dataclass(frozen=True)
class ConnectionLimits:
    keep_alive_s: float = 5.0
    headers_s: float = 10.0
    body_s: float = 60.0
    max_connections: int = 4096


def raw_response(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    """A whole `Connection: close` HTTP/1.1 response, for answers written outside any request cycle."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(body)}", "connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _RateLimitedWarning:
    """At most one log line per `every_s` for a condition that may repeat thousands of times a second."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.last = -every_s
        self.suppressed = 0

    def warn(self, message: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.suppressed += 1
            return
        logger.warning(message, extra={**fields, "since_last": self.suppressed})
        self.last, self.suppressed = now, 0


_over_capacity_log = _RateLimitedWarning()


def over_capacity_app(max_connections: int) -> Any:
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(503, f"This server has {max_connections} connections open, its limit "
                               "(--max-connections); retry shortly or on another replica.",
                          code="too_many_connections")
        await JSONResponse(body, status_code=503, headers={"Retry-After": "1", "Connection": "close"})(
            scope, receive, send)

    return refuse


class BoundedH11Protocol(H11Protocol):
    """One connection; `limits` is set on the subclass `bounded_protocol` makes."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_s  # type: ignore[assignment]  # uvicorn's is an int
        self._read_phase: str | None = None
        self._read_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if over:
            self.app = over_capacity_app(self.limits.max_connections)
            _over_capacity_log.warn("too many connections: refusing new requests with 503",
                                    max_connections=self.limits.max_connections, open=len(self.connections))
        # Idle before its first request, too: uvicorn only starts this clock after a response.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_reads()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_reads()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_read_phase(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        # h11 could not parse the request: its line, a header, or its framing (`Content-Length: -1`).
        self.transport.write(raw_response(400, error_body(
            400, "Malformed HTTP request (request line, headers or framing such as Content-Length); "
                 "the connection is closed.", code="invalid_http_request")))
        self.transport.close()

    # --- read deadlines ----------------------------------------------------------------
    def _track_reads(self) -> None:
        """Start or stop the deadline of what the connection is reading now."""
        if self.transport.is_closing():
            self._set_read_phase(None)
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._set_read_phase("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._set_read_phase("headers")   # part of a request line or its headers has arrived
        else:
            self._set_read_phase(None)

    def _set_read_phase(self, phase: str | None) -> None:
        if phase == self._read_phase:
            return
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._read_phase = phase
        if phase is not None:
            seconds = self.limits.headers_s if phase == "headers" else self.limits.body_s
            self._read_timer = self.loop.call_later(seconds, self._read_timed_out, phase, seconds)

    def _read_timed_out(self, phase: str, seconds: float) -> None:
        self._read_timer = None
        self._read_phase = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if cycle is None or not cycle.response_started:
            flag = "--timeout-request-headers" if phase == "headers" else "--timeout-request-body"
            self.transport.write(raw_response(408, error_body(
                408, f"The request {phase} did not arrive within {seconds:g} s ({flag}); the connection is "
                     "closed.", code="request_timeout")))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True        # the handler's next receive() says http.disconnect
            cycle.message_event.set()
        self.transport.close()


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), carrying `limits`."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})
