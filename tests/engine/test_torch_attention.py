"""The torch paged attention op against a naive per-query reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.attention import (
    _BACKENDS,  # noqa: PLC2701 - cleaned up after the registry test
    build_attention_metadata,
    get_attention_backend,
    register_attention_backend,
    torch_paged_attention,
)
from kvfleet.engine.attention.metadata import compute_slot_mapping


def naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float):
    """q [L, Hq, D] at positions start..start+L-1; keys/values [S, Hkv, D] for positions 0..S-1."""
    q_len, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = torch.empty_like(q)
    for i in range(q_len):
        visible = start + i + 1
        for h in range(num_heads):
            scores = keys[:visible, h // group] @ q[i, h] * scale
            out[i, h] = scores.softmax(-1) @ values[:visible, h // group]
    return out


def _case(num_heads: int, num_kv_heads: int, block_size: int, seqs: list[tuple[int, int]], seed: int):
    """seqs: (cached prefix length, new tokens). Writes the prefixes into a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 8
    num_blocks = sum(-(-(p + n) // block_size) for p, n in seqs) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # garbage elsewhere
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    for prefix, new in seqs:
        table = [free.pop() for _ in range(-(-(prefix + new) // block_size))]
        tables.append(table)
        k = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(prefix + new, num_kv_heads, head_dim, generator=gen)
        for pos in range(prefix):  # the cached prefix, as an earlier step left it
            block, off = table[pos // block_size], pos % block_size
            cache[0, block, off], cache[1, block, off] = k[pos], v[pos]
        full_k.append(k)
        full_v.append(v)
    q = torch.randn(sum(n for _, n in seqs), num_heads, head_dim, generator=gen)
    k_new = torch.cat([k[p:] for (p, _), k in zip(seqs, full_k, strict=True)])
    v_new = torch.cat([v[p:] for (p, _), v in zip(seqs, full_v, strict=True)])
    md = build_attention_metadata([n for _, n in seqs], [p + n for p, n in seqs], tables, block_size)
    return q, k_new, v_new, cache, md, full_k, full_v


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [(8, 2, 4), (4, 4, 16), (6, 1, 8)],
)
def test_matches_naive_reference(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    # full prefill, chunk after a cached prefix crossing blocks, decodes (incl. first token), long prefill
    seqs = [(0, 11), (5, 7), (12, 1), (3, 1), (0, 1), (block_size, 2 * block_size + 1), (33, 1)]
    q, k, v, cache, md, full_k, full_v = _case(num_heads, num_kv_heads, block_size, seqs, seed=num_heads)
    scale = 0.37
    out = torch_paged_attention(q, k, v, cache, md, scale)
    starts = md.query_start_loc_cpu
    for b, (prefix, _new) in enumerate(seqs):
        ref = naive_attention(q[starts[b] : starts[b + 1]], full_k[b], full_v[b], prefix, scale)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], ref, atol=1e-5, rtol=1e-5)
    # the new K/V landed at their slots
    flat = cache.view(2, -1, num_kv_heads, q.shape[-1])
    torch.testing.assert_close(flat[0, md.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, md.slot_mapping], v, atol=0, rtol=0)


def test_negative_slots_are_not_written() -> None:
    q, k, v, cache, md, _, _ = _case(4, 2, 4, [(0, 3)], seed=7)
    md.slot_mapping = torch.tensor([md.slot_mapping[0].item(), -1, md.slot_mapping[2].item()])
    skipped = compute_slot_mapping([3], [3], [md.block_tables[0].tolist()], 4)[1]
    before = cache.view(2, -1, 2, 8)[:, skipped].clone()
    torch_paged_attention(q, k, v, cache, md, 0.5)
    torch.testing.assert_close(cache.view(2, -1, 2, 8)[:, skipped], before, atol=0, rtol=0)


def test_bfloat16_close_to_float32() -> None:
    q, k, v, cache, md, _, _ = _case(8, 2, 16, [(0, 20), (30, 1), (4, 9)], seed=3)
    ref = torch_paged_attention(q, k, v, cache.clone(), md, 0.35)
    out = torch_paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), md, 0.35)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_slot_mapping_and_metadata_checks() -> None:
    # seq 0: positions 3, 4 of 5 -> block 7 offset 3, block 3 offset 0; seq 1: position 0 -> block 4
    assert compute_slot_mapping([2, 1], [5, 1], [[7, 3], [4]], 4) == [31, 12, 16]
    md = build_attention_metadata([2, 1], [5, 1], [[7, 3], [4]], 4)
    assert md.query_start_loc_cpu == [0, 2, 3] and md.seq_lens_cpu == [5, 1]
    assert md.block_tables.tolist() == [[7, 3], [4, 0]] and md.max_query_len == 2 and md.max_seq_len == 5
    with pytest.raises(ValueError, match="block_tables"):
        compute_slot_mapping([1], [9], [[0, 1]], 4)
    with pytest.raises(ValueError, match="query_lens"):
        compute_slot_mapping([3], [2], [[0]], 4)


def test_backend_selection() -> None:
    assert get_attention_backend("cpu") is torch_paged_attention
    assert get_attention_backend("cpu", name="torch") is torch_paged_attention
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cpu", name="nope")

    def fake(*args):  # pragma: no cover - never called
        raise AssertionError

    register_attention_backend("fake-cpu", fake, device_types=("cpu",), priority=99)
    try:
        assert get_attention_backend("cpu") is fake
        assert get_attention_backend("cpu", name="torch") is torch_paged_attention
    finally:
        del _BACKENDS["fake-cpu"]
