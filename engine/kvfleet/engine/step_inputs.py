"""The flat host-side inputs of one step, built in one pass over the scheduled sequences.

Pure (lists and numpy in, lists and numpy out; no torch, no device): the model runner turns
them into tensors. The same values as `attention.metadata.build_attention_metadata` plus the
token ids and positions, without its per-token validation loop: the scheduler has already
checked that every block table holds its sequence (its assert in `schedule()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfleet.engine.core.scheduler import ScheduledRequest


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int]         # [T] the new tokens, sequences end to end
    positions: list[int]         # [T]
    slot_mapping: list[int]      # [T] block_id * block_size + offset of each new token
    query_start_loc: list[int]   # [B+1]
    seq_lens: list[int]          # [B] context length after this step
    max_query_len: int
    block_tables: np.ndarray     # int32 [B, max table length], padded with 0
    # Decodes whose token is not known on the host yet (async scheduling: the runner fills them in on
    # the device from the previous step's samples): their index in input_ids, and their request ids.
    placeholder_at: list[int]
    placeholder_ids: list[str]


def build_step_inputs(scheduled: Sequence[ScheduledRequest], block_size: int, rows: "BlockTableRows") -> StepInputs:
    """One pass over the step's sequences; `rows` is brought up to date with their block tables."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    batch_rows: list[int] = []
    total = 0
    max_q = 0
    width = 0
    placeholder_at: list[int] = []
    placeholder_ids: list[str] = []
    bs = block_size
    row_of, update, lens = rows.row_of, rows.update, rows.lens
    for s in scheduled:
        start, n = s.start, s.num_new_tokens
        end = start + n
        table = s.block_ids
        row = row_of.get(s.request.request_id)
        if row is None or s.new_blocks_from < len(table) or lens[row] != len(table):
            row = update(s.request.request_id, table, s.new_blocks_from)
        batch_rows.append(row)
        if len(table) > width:
            width = len(table)
        if n == 1:   # a decode: one token, one slot
            toks = s.request.all_token_ids
            if start < len(toks):
                ids.append(toks[start])
            else:
                placeholder_at.append(total)
                placeholder_ids.append(s.request.request_id)
                ids.append(0)
            pos.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            ids.extend(s.request.all_token_ids[start:end])
            pos.extend(range(start, end))
            p = start
            while p < end:   # block by block: a run of consecutive slots each
                off = p % bs
                stop = min(end, p - off + bs)
                first = table[p // bs] * bs + off
                slots.extend(range(first, first + stop - p))
                p = stop
        total += n
        qsl.append(total)
        seq_lens.append(end)
        if n > max_q:
            max_q = n
    return StepInputs(ids, pos, slots, qsl, seq_lens, max_q, rows.gather(batch_rows, width), placeholder_at,
                      placeholder_ids)


class BlockTableRows:
    """Every running sequence's block table as a row of one persistent int32 array.

    A step writes only what changed since the sequence's last step (`changed_from`, from the
    KV manager: appended blocks, a copy-on-write replacement, or 0 for a new table) and
    gathers its batch's rows, instead of converting every table from Python lists each step.
    Rows are padded with 0 past each table's length (as `attention.metadata` pads).
    """

    def __init__(self, max_blocks: int, rows: int = 64) -> None:
        self.table = np.zeros((max(1, rows), max(1, max_blocks)), dtype=np.int32)
        self.lens: list[int] = [0] * max(1, rows)   # entries given to each row
        self.row_of: dict[str, int] = {}
        self._free: list[int] = list(range(self.table.shape[0] - 1, -1, -1))

    def _grow(self, rows: int, cols: int) -> None:
        r, c = self.table.shape
        grown = np.zeros((max(r, rows), max(c, cols)), dtype=np.int32)
        grown[:r, :c] = self.table
        self.table = grown
        self.lens.extend([0] * (grown.shape[0] - r))
        self._free.extend(range(grown.shape[0] - 1, r - 1, -1))

    def update(self, seq_id: str, blocks: Sequence[int], changed_from: int) -> int:
        """Bring `seq_id`'s row up to `blocks` (entries before `changed_from` are unchanged); its row."""
        row = self.row_of.get(seq_id)
        if row is None:
            if not self._free:
                self._grow(2 * self.table.shape[0], 0)
            row = self._free.pop()
            self.row_of[seq_id] = row
            changed_from = 0
        n = len(blocks)
        old = self.lens[row]
        start = min(changed_from, old)   # never trust entries this row has not been given
        if n > self.table.shape[1]:
            self._grow(0, max(n, 2 * self.table.shape[1]))
        if start < n:
            self.table[row, start:n] = blocks[start:]
        if n < old:
            self.table[row, n:old] = 0
        if n != old:
            self.lens[row] = n
        return row

    def gather(self, rows: Sequence[int], width: int) -> np.ndarray:
        """int32 [len(rows), max(1, width)]: the batch's block tables (a copy)."""
        return self.table[:, :max(1, width)][np.asarray(rows, dtype=np.int64)]

    def release(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.table[row, :self.lens[row]] = 0
            self.lens[row] = 0
            self._free.append(row)

