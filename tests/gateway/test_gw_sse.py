"""The stream taps: events pass on as they complete, usage is read, the injected usage chunk is dropped; a Responses
stream passes whole, its usage read from its last event."""

from __future__ import annotations

import json

from kvfleet.gateway.proxy import body_usage
from kvfleet.gateway.sse import ResponsesTap, StreamTap, Usage, read_usage
from kvfleet.gateway.testing import response_events


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
    error, done = tap.failure("The replica failed.", "upstream_disconnected").split(b"\n\n", 1)
    assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "upstream_disconnected" and done == DONE


def test_an_in_band_error_is_seen() -> None:
    tap = StreamTap(strip_usage=False)
    run(tap, event({"error": {"message": "boom", "code": "internal_error"}}) + DONE, 4)
    assert tap.error == {"message": "boom", "code": "internal_error"} and tap.done


# -- the Responses API ------------------------------------------------------------------------------------------

def typed(payload: dict[str, object]) -> bytes:
    """An event as our engine writes it: its type on the `event:` line."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode()


R_EVENTS = [typed(e) for e in response_events({"model": "m", "input": "hi"}, 3)]
R_STREAM = b"".join(R_EVENTS)   # created, in_progress, item and part added, 3 deltas, ..., response.completed


def test_a_responses_stream_passes_whole_and_its_last_event_gives_the_usage() -> None:
    assert b"response.completed" in R_EVENTS[-1] and b"[DONE]" not in R_STREAM
    for cut in (1, 3, 17, len(R_STREAM)):
        tap = ResponsesTap()
        assert run(tap, R_STREAM, cut) == R_STREAM   # nothing dropped: the usage event is the API's
        assert tap.done and tap.error is None and tap.content_events == 3
        assert tap.final_usage() == Usage(7, 3)


def test_an_incomplete_response_and_data_only_events_are_read_too() -> None:
    last = json.loads(R_EVENTS[-1].split(b"data: ", 1)[1])
    last["type"] = "response.incomplete"
    last["response"]["usage"] = {"input_tokens": 11, "output_tokens": 2, "total_tokens": 13}
    plain = [event(json.loads(e.split(b"data: ", 1)[1])) for e in R_EVENTS[:-1]]
    stream = b"".join(plain) + event(last)   # no `event:` lines: the data's type says
    tap = ResponsesTap()
    assert run(tap, stream, 5) == stream
    assert tap.done and tap.final_usage() == Usage(11, 2) and tap.content_events == 3


def test_a_responses_stream_cut_short_counts_its_deltas_and_ends_with_a_numbered_error_event() -> None:
    tap = ResponsesTap()
    head = b"".join(R_EVENTS[:6])   # created, in_progress, item added, part added, 2 deltas (numbers 0-5)
    assert run(tap, head, 7) == head
    assert not tap.done and tap.final_usage() == Usage(0, 2)
    ending = tap.failure("The replica failed.", "upstream_disconnected")
    assert ending.startswith(b"event: error\ndata: ") and ending.endswith(b"\n\n") and b"[DONE]" not in ending
    assert json.loads(ending.split(b"data: ", 1)[1]) == {
        "type": "error", "code": "upstream_disconnected", "message": "The replica failed.", "param": None,
        "sequence_number": 6}
    # the failure follows the last event's own number, not a count
    tap = ResponsesTap()
    tap.feed(typed({"type": "response.output_text.delta", "sequence_number": 41, "delta": "x"}))
    assert json.loads(tap.failure("m", "c").split(b"data: ", 1)[1])["sequence_number"] == 42


def test_an_engines_error_event_ends_a_responses_stream() -> None:
    error = {"type": "error", "sequence_number": 5, "code": "internal_error", "message": "boom", "param": None}
    tap = ResponsesTap()
    stream = b"".join(R_EVENTS[:5]) + typed(error)
    assert run(tap, stream, 9) == stream
    assert tap.done and tap.error == error and tap.final_usage() == Usage(0, 1)
    failed = json.loads(R_EVENTS[-1].split(b"data: ", 1)[1])
    failed["type"] = "response.failed"
    failed["response"].update(status="failed", error={"code": "server_error", "message": "boom"})
    tap = ResponsesTap()
    run(tap, typed(failed), 4)
    assert tap.done and tap.error == {"code": "server_error", "message": "boom"} and tap.final_usage() == Usage(7, 3)


def test_usage_is_read_in_either_naming_from_a_whole_body() -> None:
    chat = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    response = json.loads(R_EVENTS[-1].split(b"data: ", 1)[1])["response"]
    assert body_usage(json.dumps(chat).encode()) == Usage(5, 3)
    assert body_usage(json.dumps(response).encode()) == Usage(7, 3)
    assert body_usage(b'{"usage": null}') is None and body_usage(b"[1]") is None and body_usage(b"{oops") is None
    assert read_usage({"input_tokens": "7", "output_tokens": -1}) == Usage(0, 0)   # never a crash on junk
