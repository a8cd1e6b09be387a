"""vLLM's `allowed_token_ids` and `bad_words` as per-sequence constraints (core.grammar): the sampler masks what they
ban as it masks what a structured output does not allow, and both hold together (core.grammar.AllOf)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvfleet.engine.core.grammar import AllOf, BannedSequences, TokenGrammar, TokenSet
from kvfleet.engine.sampling_params import SamplingParams


def pack_tokens(token_ids: list[int], words: int) -> np.ndarray:
    """int32 [words]: bit t % 32 of word t // 32 set for each token t (llguidance's layout)."""
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[token_ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def bad_word_sequences(words: list[str], tokenizer: Any) -> list[tuple[int, ...]]:
    """Each word's token sequences, as it starts the output and after a space (vLLM's two spellings)."""
    if tokenizer is None:
        raise ValueError("bad_words: this model has no tokenizer to spell them with")
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def token_rules(params: SamplingParams, vocab_size: int, tokenizer: Any) -> Optional[TokenGrammar]:
    """The request's allowed_token_ids and bad_words as one constraint; None without either."""
    words = -(-vocab_size // 32)
    parts: list[TokenGrammar] = []
    if params.allowed_token_ids is not None:
        parts.append(TokenSet(pack_tokens(params.allowed_token_ids, words)))
    if params.bad_words:
        parts.append(BannedSequences(bad_word_sequences(params.bad_words, tokenizer), words))
    return all_of(parts)


def all_of(parts: list[TokenGrammar]) -> Optional[TokenGrammar]:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(parts)
