"""AttentionMetadata: where a step's tokens sit in the paged KV cache (see docs/engine-interfaces.md)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # int64 [T]: slot where each new token's K/V is written (-1 = skip)
    query_start_loc: torch.Tensor   # int32 [B+1]: cumulative query lengths
    seq_lens: torch.Tensor          # int32 [B]: context length after this step (cached + new)
    block_tables: torch.Tensor      # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copies, for the torch path and for planning
    seq_lens_cpu: list[int]
    # The block tables on the host (int32 [B, width]), where the builder has them: the shared-prefix plan of
    # decode rows (`attention.shared_prefix`) is made from them; None: no such plan.
    block_tables_cpu: np.ndarray | None = None
    # The step's plans of the attention backend (index tensors, tiles), by name: built by the first
    # layer from the host lists above, reused by the others. Not an input: every new metadata starts empty.
    plans: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


def compute_slot_mapping(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> list[int]:
    """Pure: the physical slot of every new token, sequences laid end to end."""
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if q_len > s_len:
            raise ValueError(f"query_lens: {q_len} new tokens exceed seq_len {s_len}")
        if len(table) * block_size < s_len:
            raise ValueError(f"block_tables: {len(table)} blocks of {block_size} cannot hold {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


def _padded_tables(block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """int32 [B, width] padded with 0; numpy over one flat pass (~4x faster than torch.tensor on
    nested lists, which a decode step of hundreds of sequences pays every step)."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = max(1, int(lens.max()) if lens.size else 1)
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lens.sum()))
    padded = np.zeros((len(block_tables), width), dtype=np.int32)
    padded[np.arange(width)[None, :] < lens[:, None]] = flat
    return padded


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Metadata for one step from plain lists (used by tests, and usable by a model runner)."""
    if not query_lens:
        raise ValueError("query_lens: a step needs at least one sequence")
    slots = compute_slot_mapping(query_lens, seq_lens, block_tables, block_size)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + int(q_len))
    padded = _padded_tables(block_tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(padded).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[int(s) for s in seq_lens],
        block_tables_cpu=padded,
    )
