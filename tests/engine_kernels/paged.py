"""Random paged-attention batches for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.attention import AttentionMetadata, build_attention_metadata


@dataclass
class PagedBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int


def make_batch(gen: torch.Generator, seq_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int,
               block_size: int, dtype: torch.dtype, extra_blocks: int = 3) -> PagedBatch:
    """Sequences with random cached prefixes in shuffled physical blocks, plus new tokens."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 1
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = torch.tensor(perm[i:i + nb], dtype=torch.int32)
        i += nb
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    total = sum(q_lens)
    slots = []
    for b, (s, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for p in range(s - ql, s):
            slots.append(int(tables[b, p // block_size]) * block_size + p % block_size)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return PagedBatch(
        q=torch.randn(total, hq, d, generator=gen).to(dtype),
        k=torch.randn(total, hkv, d, generator=gen).to(dtype),
        v=torch.randn(total, hkv, d, generator=gen).to(dtype),
        kv_cache=cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        max_query_len=max(q_lens),
    )


def metadata_step(gen: torch.Generator, q_lens: list[int], seq_lens: list[int], block_size: int = 8,
                  hq: int = 4, hkv: int = 2, d: int = 16, extra_blocks: int = 2
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step as the attention ops take it: q/k/v of its new tokens, a random cache over shuffled blocks, and
    its `AttentionMetadata` (host lists included)."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[i:i + n])
        i += n
    md = build_attention_metadata(q_lens, seq_lens, tables, block_size)
    t = sum(q_lens)
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen)
    q = torch.randn(t, hq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, d, generator=gen)
    return q, k, v, cache, md


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
