"""Reading a server-sent-events stream as it passes through (pure, incremental).

Each complete event (`...\\n\\n`) is handed on as soon as it is complete; only events that may carry
the usage or an error are parsed. A stream that ends without its usage (client gone, replica died) counts
one completion token per content event (kvfleet engines send one event per decoded step, so this is exact
for them at one token per step) and no prompt tokens. Two kinds of streams:

- Chat and completions (`StreamTap`): `data:` chunks ending `data: [DONE]`. The final usage chunk
  (`"choices": []` with `usage`) gives the token counts; it is dropped when the gateway asked for it and
  the client did not.
- The Responses API (`ResponsesTap`): typed events (`event: <type>` and `data: {"type": <type>,
  "sequence_number": n, ...}`), ending with `response.completed` / `response.incomplete` (the usage under
  `response`) or an `error` event, and no `[DONE]`. Nothing is dropped: the usage is part of the API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def read_usage(usage: Any) -> Usage | None:
    """An answer's `usage` in either of OpenAI's namings: `prompt_tokens` / `completion_tokens` (chat and
    completions), `input_tokens` / `output_tokens` (the Responses API); None if it is not an object."""
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        return Usage(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")))
    return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")))


class Tap(Protocol):
    """What the proxy needs of a stream as it passes: the bytes to send on, how it ended, its usage."""

    done: bool   # the stream's own end was seen: `[DONE]`, or a Responses stream's last event
    error: dict[str, Any] | None   # the engine's in-band error, if it sent one

    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...

    def final_usage(self) -> Usage: ...

    def failure(self, message: str, code: str) -> bytes:
        """The events that end the stream when its replica failed before it did."""
        ...


def complete_events(buf: bytes) -> tuple[bytes, bytes]:
    """(the events `buf` holds whole, each ending in a blank line; the start of the next one)."""
    end = buf.rfind(b"\n\n")
    if end < 0:
        return b"", buf
    return buf[:end + 2], buf[end + 2:]


def _data(event: bytes) -> bytes | None:
    """The data of an event (single `data:` line events, as OpenAI servers send them)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


class StreamTap:
    """A chat or completion stream: `data:` chunks ending `data: [DONE]`."""

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: Usage | None = None
        self.error: dict[str, Any] | None = None
        self.content_events = 0
        self.done = False
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """The bytes to send on now: every event completed by `data`."""
        complete, self._pending = complete_events(self._pending + data)
        if not complete:
            return b""
        if not self.strip_usage and b'"usage"' not in complete and b'"error"' not in complete:
            self._count_plain(complete)
            return complete
        out = []
        for event in complete.split(b"\n\n")[:-1]:
            if self._keep(event):
                out.append(event + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _count_plain(self, complete: bytes) -> None:
        for event in complete.split(b"\n\n")[:-1]:
            self._observe(event, None)

    def _keep(self, event: bytes) -> bool:
        data = _data(event)
        parsed: Any = None
        if data is not None and (b'"usage"' in data or b'"error"' in data) and data != b"[DONE]":
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = None
        usage_only = self._observe(event, parsed)
        return not (usage_only and self.strip_usage)

    def _observe(self, event: bytes, parsed: Any) -> bool:
        """Record what `event` says; True if it is the final usage-only chunk."""
        data = _data(event)
        if data is None:
            return False
        if data == b"[DONE]":
            self.done = True
            return False
        if isinstance(parsed, dict):
            if isinstance(parsed.get("error"), dict):
                self.error = parsed["error"]
                return False
            usage = read_usage(parsed.get("usage"))
            if usage is not None:
                self.usage = usage
                if parsed.get("choices") == []:
                    return True
        if b'"role"' not in data:  # a chat stream's first chunk carries the role and no token
            self.content_events += 1
        return False

    def final_usage(self) -> Usage:
        return self.usage or Usage(0, self.content_events)

    def failure(self, message: str, code: str) -> bytes:
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n" + DONE + b"\n\n"


TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def _event_type(event: bytes) -> str | None:
    """The `event:` line's type (the Responses API names every event on one)."""
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip().decode("utf-8", "replace")
    return None


def _json(data: bytes | None) -> Any:
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


class ResponsesTap:
    """A Responses API stream: every event passes on; the last one's `response.usage` is the usage, a
    `*.delta` event the fallback's content event, an `error` event (or `response.failed`) the error."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.error: dict[str, Any] | None = None
        self.content_events = 0
        self.events = 0
        self.done = False
        self._pending = b""
        self._last = b""   # the last event seen: the failure event's number follows its own

    def feed(self, data: bytes) -> bytes:
        complete, self._pending = complete_events(self._pending + data)
        for event in complete.split(b"\n\n")[:-1]:
            self._observe(event)
        return complete

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        if rest.strip():
            self.events += 1
            self._last = rest
        return rest

    def _observe(self, event: bytes) -> None:
        self.events += 1
        self._last = event
        kind = _event_type(event)
        parsed = None
        if kind is None:   # no `event:` line: the type is the data's
            parsed = _json(_data(event))
            kind = parsed.get("type") if isinstance(parsed, dict) else None
        if not isinstance(kind, str):
            return
        if kind.endswith(".delta"):
            self.content_events += 1
        elif kind in TERMINAL:
            self.done = True
            parsed = parsed if parsed is not None else _json(_data(event))
            if isinstance(parsed, dict):
                self._ended(kind, parsed)

    def _ended(self, kind: str, parsed: dict[str, Any]) -> None:
        if kind == "error":
            self.error = parsed
            return
        response = parsed.get("response")
        response = response if isinstance(response, dict) else {}
        self.usage = read_usage(response.get("usage")) or self.usage
        if kind == "response.failed":   # OpenAI's end of a response that failed: its error, whatever its shape
            error = response.get("error")
            self.error = error if isinstance(error, dict) else {}

    def final_usage(self) -> Usage:
        return self.usage or Usage(0, self.content_events)

    def next_sequence_number(self) -> int:
        """The number the next event takes: after the last one's (0-based and consecutive as OpenAI numbers them,
        so the count of events when the last one cannot be read)."""
        parsed = _json(_data(self._last))
        seq = parsed.get("sequence_number") if isinstance(parsed, dict) else None
        return seq + 1 if isinstance(seq, int) and not isinstance(seq, bool) else self.events

    def failure(self, message: str, code: str) -> bytes:
        """OpenAI's `error` event, numbered after the last event (a Responses stream has no `[DONE]`)."""
        body = {"type": "error", "code": code, "message": message, "param": None,
                "sequence_number": self.next_sequence_number()}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
