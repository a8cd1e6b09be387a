"""Which decoding sequences share a KV prefix, planned per step for cascade attention.

Sequences share physical KV blocks when the prefix cache found their prompt's start (a common system
prompt) or when one request samples n completions. `plan_shared_prefixes` (pure: numpy in, numpy out) finds,
among a step's decode sequences, groups whose block tables begin with the same blocks, and splits each group
into work items of at most `members_per_item` sequences for `kernels.shared_prefix`, which reads each shared
prefix once per item instead of once per sequence. `SharedPrefixBuffers` holds a plan on the device, in
buffers of fixed size that a CUDA graph can be captured over.

KVFLEET_SHARED_PREFIX_DECODE=0 turns the pass off (issue 16's A/B); KVFLEET_SHARED_PREFIX_MIN_TOKENS (default
64) is the shortest prefix worth it: below it, the partial outputs written and read cost more than the keys
saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.engine.env_settings import EnvSettingError

# Not importing the kernels: the graph runner imports this module on every device, and the kernels compile.
ITEM_FIELDS = 4   # a work item's int32 fields, as kernels.shared_prefix takes them
PLAN_KEY = "shared_prefix"   # AttentionMetadata.plans key: SharedPrefixTensors, or None for no shared-prefix pass


def _enabled_from_env() -> bool:
    raw = os.environ.get("KVFLEET_SHARED_PREFIX_DECODE", "").strip() or "1"
    if raw not in ("0", "1"):
        raise EnvSettingError(f"KVFLEET_SHARED_PREFIX_DECODE: expected '0' or '1', got {raw!r}")
    return raw == "1"


def _min_tokens_from_env() -> int:
    raw = os.environ.get("KVFLEET_SHARED_PREFIX_MIN_TOKENS", "").strip() or "64"
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise EnvSettingError(f"KVFLEET_SHARED_PREFIX_MIN_TOKENS: expected a positive token count, got {raw!r}")
    return n


ENABLED = _enabled_from_env()
MIN_TOKENS = _min_tokens_from_env()


@dataclass(frozen=True)
class SharedPrefixPlan:
    """A step's groups of decode sequences over a shared prefix, as the kernels take them."""

    items: np.ndarray      # int32 [K, 4]: a member row (its block table holds the prefix), prefix tokens,
    #                        first index in `members`, member count
    members: np.ndarray    # int32 [M]: the members' rows in the step's batch, item after item
    kv_start: np.ndarray   # int32 [B]: each row's shared prefix in tokens (0 = none): its decode reads from there

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])


def plan_shared_prefixes(
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    decode: np.ndarray,
    block_size: int,
    members_per_item: int,
    min_tokens: int | None = None,
    max_items: int | None = None,
) -> SharedPrefixPlan | None:
    """Groups of decode rows (`decode`: bool [B]) whose block tables start with the same blocks.

    A group's prefix is the blocks all its members have in common, cut to full blocks before every member's
    newest token, so it never holds a token some member is writing. Rows are sorted by their tables' bytes:
    rows with equal leading blocks end up next to each other, and a group is a run of neighbours that share
    at least `min_tokens` (default KVFLEET_SHARED_PREFIX_MIN_TOKENS). None when no group is found. With
    `max_items`, the largest groups are kept.
    """
    rows = np.flatnonzero(decode)
    if rows.size < 2 or block_tables.shape[1] == 0:
        return None
    tables = np.ascontiguousarray(block_tables[rows], dtype=np.int32)
    if np.unique(tables[:, 0]).size == rows.size:
        return None   # no two sequences begin with the same block: nothing is shared (the common case, cheap)
    width = tables.shape[1]
    order = np.argsort(tables.view(np.dtype((np.void, 4 * width))).ravel(), kind="stable")
    tables = tables[order]
    rows = rows[order]
    full = (np.asarray(seq_lens, dtype=np.int64)[rows] - 1) // block_size
    same = tables[1:] == tables[:-1]
    lcp = np.where(same.all(axis=1), width, same.argmin(axis=1))
    lcp = np.minimum(lcp, np.minimum(full[1:], full[:-1]))       # shared blocks with a neighbour
    min_blocks = max(1, -(-(MIN_TOKENS if min_tokens is None else min_tokens) // block_size))
    linked = lcp >= min_blocks
    groups: list[tuple[int, int, int]] = []   # (first sorted index, end, prefix blocks)
    i, n = 0, rows.size
    while i < n - 1:
        if not linked[i]:
            i += 1
            continue
        j = i
        while j < n - 1 and linked[j]:
            j += 1
        groups += _best_groups(lcp, i, j + 1)[1]
        i = j + 1
    if not groups:
        return None
    per = max(1, members_per_item)
    if max_items is not None:
        groups.sort(key=lambda g: g[1] - g[0], reverse=True)
        kept, used = [], 0
        for g in groups:
            need = -(-(g[1] - g[0]) // per)
            if used + need <= max_items:
                kept.append(g)
                used += need
        groups = kept
        if not groups:
            return None
    items: list[tuple[int, int, int, int]] = []
    members: list[np.ndarray] = []
    kv_start = np.zeros(block_tables.shape[0], dtype=np.int32)
    at = 0
    for start, end, blocks in groups:
        tokens = blocks * block_size
        kv_start[rows[start:end]] = tokens
        for s in range(start, end, per):
            e = min(end, s + per)
            items.append((int(rows[start]), tokens, at, e - s))
            members.append(rows[s:e])
            at += e - s
    return SharedPrefixPlan(np.asarray(items, dtype=np.int32).reshape(-1, ITEM_FIELDS),
                            np.concatenate(members).astype(np.int32), kv_start)


def _best_groups(lcp: np.ndarray, start: int, end: int, depth: int = 0) -> tuple[int, list[tuple[int, int, int]]]:
    """Sorted rows [start, end), neighbours linked by `lcp[start:end - 1]` shared blocks: (blocks of keys saved,
    the groups). One group shares the weakest link's blocks; when its two sides save more apart (two system
    prompts that begin with the same 64 tokens, say), they are split there, and so on down (deep splits stop
    at 32 levels: the rest stays one group)."""
    links = lcp[start:end - 1]
    weakest = int(links.min())
    whole = (end - start - 1) * weakest
    if end - start < 3 or weakest == int(links.max()) or depth >= 32:
        return whole, [(start, end, weakest)]
    k = start + int(links.argmin())   # the left side ends at row k, the right side starts at k + 1
    saved, groups = 0, []
    for a, b in ((start, k + 1), (k + 1, end)):
        if b - a >= 2:
            s, g = _best_groups(lcp, a, b, depth + 1)
            saved += s
            groups += g
    return (saved, groups) if saved > whole else (whole, [(start, end, weakest)])


@dataclass
class SharedPrefixTensors:
    """A plan on the device: the kernels' work list and the partial results' buffers."""

    items: torch.Tensor        # int32 [capacity, 4] (entries with no member are idle)
    members: torch.Tensor      # int32 [>= M]
    kv_start: torch.Tensor     # int32 [>= B]
    part_out: torch.Tensor     # float32 [>= B, Hq, D]
    part_lse: torch.Tensor     # float32 [>= B, Hq]


def plan_to_device(plan: SharedPrefixPlan, num_q_heads: int, head_dim: int, device: torch.device,
                   non_blocking: bool) -> SharedPrefixTensors:
    """One step's plan in fresh device tensors (eager steps): one host-to-device copy of the index arrays."""
    b = plan.kv_start.shape[0]
    packed = torch.from_numpy(np.concatenate([plan.items.reshape(-1), plan.members, plan.kv_start]))
    if device.type == "cuda" and non_blocking:
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=non_blocking)
    k, m = plan.num_items, plan.members.shape[0]
    return SharedPrefixTensors(
        items=packed[:k * ITEM_FIELDS].view(k, ITEM_FIELDS), members=packed[k * ITEM_FIELDS:k * ITEM_FIELDS + m],
        kv_start=packed[k * ITEM_FIELDS + m:],
        part_out=torch.empty((b, num_q_heads, head_dim), dtype=torch.float32, device=device),
        part_lse=torch.empty((b, num_q_heads), dtype=torch.float32, device=device))


class SharedPrefixBuffers:
    """Static device buffers for captured decode steps of up to `max_batch` sequences: a bucket of `bs`
    sequences gets `capacity(bs)` work items (a plan with more keeps its largest groups)."""

    def __init__(self, max_batch: int, num_q_heads: int, head_dim: int, device: torch.device) -> None:
        self.max_batch = max_batch
        cap = self.capacity(max_batch)
        self.index = torch.zeros(cap * ITEM_FIELDS + 2 * max_batch, dtype=torch.int32, device=device)
        self.part_out = torch.zeros((max_batch, num_q_heads, head_dim), dtype=torch.float32, device=device)
        self.part_lse = torch.zeros((max_batch, num_q_heads), dtype=torch.float32, device=device)
        self.device = device

    @staticmethod
    def capacity(batch: int) -> int:
        """Work items for a batch: every group has two members or more, so half the batch holds most plans."""
        return max(1, batch // 2)

    def tensors(self, bs: int) -> SharedPrefixTensors:
        """The views a bucket of `bs` sequences is captured with."""
        cap, top = self.capacity(bs), self.capacity(self.max_batch) * ITEM_FIELDS
        return SharedPrefixTensors(
            items=self.index[:cap * ITEM_FIELDS].view(cap, ITEM_FIELDS),
            members=self.index[top:top + self.max_batch][:bs],
            kv_start=self.index[top + self.max_batch:][:bs],
            part_out=self.part_out[:bs], part_lse=self.part_lse[:bs])

    def load(self, plan: SharedPrefixPlan, bs: int) -> None:
        """Write `plan` (at most `capacity(bs)` items, rows < bs) for a replay of bucket `bs`; no host wait."""
        cap, top = self.capacity(bs), self.capacity(self.max_batch) * ITEM_FIELDS
        if plan.num_items > cap or plan.kv_start.shape[0] > bs:
            raise ValueError(f"plan: {plan.num_items} items for {plan.kv_start.shape[0]} rows exceed bucket {bs}")
        host = np.zeros(self.index.shape[0], dtype=np.int32)
        host[:plan.items.size] = plan.items.reshape(-1)          # the rest: idle items (no member)
        host[top:top + plan.members.shape[0]] = plan.members
        host[top + self.max_batch:top + self.max_batch + plan.kv_start.shape[0]] = plan.kv_start
        src = torch.from_numpy(host)
        if self.device.type == "cuda":
            src = src.pin_memory()    # a pageable copy would wait for the step in flight
        self.index.copy_(src, non_blocking=True)
