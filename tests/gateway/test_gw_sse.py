"""The stream tap: events pass on as they complete, usage is read, the injected usage chunk is dropped."""

from __future__ import annotations

import json

from kvfleet.gateway.sse import StreamTap, Usage


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKENS = [event({"choices": [{"index": 0, "delta": {"content": t}}]}) for t in ("Hel", "lo", "!")]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(TOKENS) + USAGE + DONE


def run(tap: StreamTap, data: bytes, cut: int) -> bytes:
    out = b""
    for i in range(0, len(data), cut):
        out += tap.feed(data[i:i + cut])
    return out + tap.flush()


def test_passes_everything_when_the_client_asked_for_usage_whatever_the_chunking() -> None:
    for cut in (1, 3, 17, len(STREAM)):
        tap = StreamTap(strip_usage=False)
        assert run(tap, STREAM, cut) == STREAM
        assert tap.usage == Usage(5, 3) and tap.done and tap.error is None


def test_drops_the_usage_chunk_the_gateway_asked_for() -> None:
    for cut in (1, 5, len(STREAM)):
        tap = StreamTap(strip_usage=True)
        assert run(tap, STREAM, cut) == ROLE + b"".join(TOKENS) + DONE
        assert tap.final_usage() == Usage(5, 3)


def test_nothing_is_held_back_once_an_event_is_complete() -> None:
    tap = StreamTap(strip_usage=True)
    assert tap.feed(TOKENS[0][:-1]) == b""
    assert tap.feed(b"\n") == TOKENS[0]


def test_a_stream_cut_short_counts_its_content_events() -> None:
    tap = StreamTap(strip_usage=True)
    run(tap, ROLE + TOKENS[0] + TOKENS[1], 7)
    assert not tap.done and tap.final_usage() == Usage(0, 2)


def test_an_in_band_error_is_seen() -> None:
    tap = StreamTap(strip_usage=False)
    run(tap, event({"error": {"message": "boom", "code": "internal_error"}}) + DONE, 4)
    assert tap.error == {"message": "boom", "code": "internal_error"} and tap.done
