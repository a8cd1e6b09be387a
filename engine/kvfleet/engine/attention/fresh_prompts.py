"""Which prompts of a step the Gluon prefill kernel attends for (``KVFLEET_PREFILL_KERNEL=gluon``): pure.

The Gluon kernel (`kernels.prefill_attention_gluon`) reads every key from the step's own k/v, so it only takes a
fresh prompt (no cached prefix: its sequence is as long as its query), and with 128-row query tiles it only wins on
long ones: on an H200 it ran 8 x 1,024 tokens at 203 TFLOP/s against v2's 221, 2 x 4,096 at 379 against 342
(issue 16, lease 12). The rest of the step (chunks over a cached prefix, short prompts, decode rows) stays on v2.
"""

from __future__ import annotations

from collections.abc import Sequence

# the shortest fresh prompt the Gluon kernel takes (between lease 12's 1,024, where v2 wins, and 4,096, where it loses)
GLUON_MIN_QUERY_TOKENS = 2048


def fresh_long_prompts(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                       min_tokens: int = GLUON_MIN_QUERY_TOKENS) -> list[bool]:
    """One flag a sequence: a fresh prompt (nothing cached before its query) of at least ``min_tokens`` tokens."""
    flags = []
    for b in range(len(query_start_loc) - 1):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        flags.append(q_len >= max(min_tokens, 2) and seq_lens[b] == q_len)
    return flags
