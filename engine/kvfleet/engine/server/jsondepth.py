"""How deep a JSON text nests, found without parsing it (and without recursion).

Python's `json` module recurses once per level of nesting (a few hundred levels away from the
interpreter's recursion limit), and so does any recursive walk of what it returns. A request body
is measured here first, in a few C-speed passes over its bytes, so that no body shape
ever reaches a parser or validator deeper than `MAX_JSON_DEPTH`.

Standard library only: the gateway imports it to bound bodies the same way.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate

# OpenAI request bodies nest 5 levels (`messages[i].content[j].text`); JSON schemas in tools or
# `response_format` a few more. 64 leaves room for any real request.
MAX_JSON_DEPTH = 64

_ESCAPE = re.compile(rb"\\.", re.DOTALL)     # removed first, so no quote below is an escaped one
_STRING = re.compile(rb'"[^"]*"')             # linear: every attempt starts at a quote and ends at the next
# Structure bytes as signed steps: an opener is +1, a closer -1 (0xff as a signed char); the rest is dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_CHUNK = 1 << 20
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text `body` nests arrays and objects more than `limit` levels deep.

    Brackets inside strings do not count. In a malformed text the unclosed openers count as well, so
    what a parser would descend into before failing is bounded too.
    """
    if body.count(b"[") + body.count(b"{") <= limit:   # the common case: a handful of brackets
        return False
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):  # json.loads accepts UTF-16/32 bodies too
        body = body.decode(encoding, errors="replace").encode("utf-8")
    steps = array("b", _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(_STEPS, delete=_NOT_BRACKETS))
    # The deepest point is the highest running sum, taken a chunk at a time so a deep text stops early
    # (C-speed, ~50 ns a bracket: 32 MiB of nothing but brackets takes about a second, less than parsing it).
    level = 0
    for start in range(0, len(steps), _CHUNK):
        chunk = steps[start:start + _CHUNK]
        if max(accumulate(chunk, initial=level)) > limit:
            return True
        level += sum(chunk)
    return False
