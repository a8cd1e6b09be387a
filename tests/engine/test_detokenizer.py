"""Incremental detokenization: text only grows, no half characters, stop strings cut exactly."""

from __future__ import annotations

import pytest

from kvfleet.engine.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from kvfleet.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_dir)


TEXT = "Once upon a time, café naïve — 東京 😀 the end."


def test_streamed_text_equals_full_decode_and_never_shows_half_characters(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    seen = []
    for i in range(1, len(ids) + 1):
        assert d.update(ids[:i]) is None
        seen.append(d.text)
        assert "\ufffd" not in d.text
    assert d.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_hold_back(tokenizer, include: bool) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, stop=("naïve", "zzz"), include_stop_str_in_output=include)
    shown = []
    hit = None
    for i in range(1, len(ids) + 1):
        hit = d.update(ids[:i])
        shown.append(d.visible_text(finished=hit is not None))
        if hit:
            break
    assert hit == "naïve"
    cut = TEXT.index("naïve")
    assert d.text == (TEXT[:cut + len("naïve")] if include else TEXT[:cut])
    assert all(d.text.startswith(s) for s in shown)        # a partial stop string was never shown
