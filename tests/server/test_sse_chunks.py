"""The streamed completion's text-only chunks are built from a per-stream template (issue 16: the JSON encoding of
each chunk was most of the HTTP path's host time per token); they must be the very bytes `sse(chunk)` gives."""

from __future__ import annotations

import random

from kvfleet.engine.server.serving import TextChunks, sse


def test_text_chunks_equal_the_generic_encoding() -> None:
    rng = random.Random(0)
    alphabet = ["a", " ", "é", "日本", '"', "\\", "\n", "\t", "\x00", "\x1f", "\u2028", "😀", "token_id:12", "/"]
    for i in range(500):
        rid = f"cmpl-{rng.getrandbits(64):x}-{i % 3}"
        model = rng.choice(["tiny", "bench/models/llama-3.1-8b", 'odd "name" é'])
        created = rng.randrange(0, 2**31)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 8)))
        index = rng.randrange(0, 70)
        chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                 "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None,
                              "stop_reason": None}]}
        assert TextChunks(rid, "text_completion", created, model).text(index, text) == sse(chunk)
