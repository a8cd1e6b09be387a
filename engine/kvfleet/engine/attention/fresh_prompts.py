"""Which prompts of a step the Gluon prefill kernels attend for (``KVFLEET_PREFILL_KERNEL=gluon``/``gluon-chunks``):
pure.

The Gluon kernel (`kernels.prefill_attention_gluon`) reads a fresh prompt's keys from the step's own k/v (no cached
prefix: its sequence is as long as its query), and with 128-row query tiles it only wins on long ones: on an H200 it
ran 8 x 1,024 tokens at 203 TFLOP/s against v2's 221, 2 x 4,096 at 379 against 342 (issue 16, lease 12). Its paged
form (`prefill_attention_gluon_paged`) reads every key of a chunk over a cached prefix from the cache, where v2 ran
at ~300 TFLOP/s against FlashAttention-3's 582 (lease 11, a 2k chunk over 6k cached keys). The rest of the step
(short prompts and chunks, decode rows) stays on v2.
"""

from __future__ import annotations

from collections.abc import Sequence

# the shortest fresh prompt the Gluon kernel takes (between lease 12's 1,024, where v2 wins, and 4,096, where it loses)
GLUON_MIN_QUERY_TOKENS = 2048
# a chunk over a cached prefix the paged kernel takes: a whole 128-row query tile at least, and a sequence long enough
# that each program reads many key tiles (its set-up amortized, as for fresh prompts of GLUON_MIN_QUERY_TOKENS)
GLUON_CHUNK_MIN_QUERY_TOKENS = 128
GLUON_CHUNK_MIN_KEYS = 2048


def fresh_long_prompts(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                       min_tokens: int = GLUON_MIN_QUERY_TOKENS) -> list[bool]:
    """One flag a sequence: a fresh prompt (nothing cached before its query) of at least ``min_tokens`` tokens."""
    flags = []
    for b in range(len(query_start_loc) - 1):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        flags.append(q_len >= max(min_tokens, 2) and seq_lens[b] == q_len)
    return flags


def long_prefix_chunks(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                       min_query: int = GLUON_CHUNK_MIN_QUERY_TOKENS, min_keys: int = GLUON_CHUNK_MIN_KEYS
                       ) -> list[bool]:
    """One flag a sequence: a chunk over a cached prefix (keys before its query) of at least ``min_query`` tokens,
    in a sequence of at least ``min_keys`` keys."""
    flags = []
    for b in range(len(query_start_loc) - 1):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        flags.append(q_len >= max(min_query, 2) and seq_lens[b] > q_len and seq_lens[b] >= min_keys)
    return flags
