"""How many characters one token can stand for, read from the tokenizer: a text longer than
`max_model_len` times that cannot fit the context, so it is refused before it is tokenized
(tokenizing 30 MiB takes tens of seconds of CPU).

The bound holds for tokenizers that keep every character of the text (byte-level BPE, SentencePiece
with byte fallback): each token then covers at most as many characters as its longest vocabulary
entry has (a byte-level entry has one character per byte, and a character is at least one byte).
Unicode normalization may compose up to 4 code points into one, so NFC/NFKC multiply the bound by 4.
A tokenizer that may drop or merge text (whitespace splitting, stripping, unknown runs fused into one
token) gets no bound at all: nothing is refused early that could have fit.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

COMPOSE_FACTOR = 4   # NFC composes at most 4 code points into one (e.g. U+1F82)

_KEEP_NORMALIZERS = {"Prepend", "Lowercase", "ByteLevel"}
_COMPOSING_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
_KEEP_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}   # keep what they split on unless told to remove it


def _normalizer_factor(spec: Mapping[str, Any] | None) -> int | None:
    """How many characters of input at most become one character of normalized text (None: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            inner = _normalizer_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _KEEP_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSE_FACTOR
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), str(spec.get("content", ""))
        if "String" not in pattern or not content:
            return None   # a regex, or a replacement that deletes
        return max(1, -(-len(str(pattern["String"])) // len(content)))
    return None           # strip, strip accents, BERT cleaning, precompiled maps: may drop text


def _pre_tokenizer_keeps_text(spec: Mapping[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(part) for part in spec.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEP_PRE_TOKENIZERS   # Whitespace, WhitespaceSplit, BertPreTokenizer drop whitespace


def _model_keeps_text(spec: Mapping[str, Any]) -> bool:
    kind = spec.get("type")
    if spec.get("byte_fallback"):
        return True
    if kind == "BPE":
        return not (spec.get("unk_token") and spec.get("fuse_unk"))   # fused: a run of unknowns is one token
    return False          # Unigram fuses unknown runs; WordPiece and WordLevel map whole words to [UNK]


def chars_per_token_bound(tokenizer_spec: Mapping[str, Any], vocabulary: Iterable[str]) -> int | None:
    """Most characters of input text one token can stand for, from a tokenizer.json document and the
    vocabulary (added tokens included); None when this tokenizer may drop or merge text."""
    factor = _normalizer_factor(tokenizer_spec.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps_text(tokenizer_spec.get("pre_tokenizer")):
        return None
    if not _model_keeps_text(tokenizer_spec.get("model") or {}):
        return None
    longest = max((len(token) for token in vocabulary), default=0)
    return longest * factor if longest else None


def tokenizer_chars_per_token(tokenizer: Any) -> int | None:
    """`chars_per_token_bound` of a loaded Hugging Face tokenizer; None for one without a fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)   # only fast tokenizers describe themselves
    if backend is None:
        return None
    return chars_per_token_bound(json.loads(backend.to_str()), backend.get_vocab(with_added_tokens=True))
