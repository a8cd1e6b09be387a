"""Reading a server-sent-events stream as it passes through (pure, incremental).

Each complete event (`...\\n\\n`) is handed on as soon as it is complete; only events that may carry
`usage` or an `error` are parsed. The final usage chunk (`"choices": []` with `usage`) gives the token
counts; it is dropped when the gateway asked for it and the client did not. A stream that ends without
it (client gone, replica died) counts one completion token per content event (kvfleet engines send one
event per decoded step, so this is exact for them at one token per step) and no prompt tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


def _data(event: bytes) -> bytes | None:
    """The data of an event (single `data:` line events, as OpenAI servers send them)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


class StreamTap:
    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage: Usage | None = None
        self.error: dict[str, Any] | None = None
        self.content_events = 0
        self.done = False
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """The bytes to send on now: every event completed by `data`."""
        buf = self._pending + data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._pending = buf
            return b""
        self._pending = buf[end + 2:]
        complete = buf[:end + 2]
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
            usage = parsed.get("usage")
            if isinstance(usage, dict):
                self.usage = Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                if parsed.get("choices") == []:
                    return True
        if b'"role"' not in data:  # a chat stream's first chunk carries the role and no token
            self.content_events += 1
        return False

    def final_usage(self) -> Usage:
        return self.usage or Usage(0, self.content_events)
