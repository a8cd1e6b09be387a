"""The second prefill kernel (`prefill_attention_v2`) against the PyTorch paged-attention reference."""

import pytest
import torch

from kvfleet.engine.kernels import paged_attention_ref, reshape_and_cache
from kvfleet.engine.kernels.prefill_attention import prefill_work
from kvfleet.engine.kernels.prefill_attention_v2 import prefill_attention_v2

from .paged import TOL, make_batch, rel_err

# fresh prompts (one a multiple of the tiles, one not), chunks after cached prefixes (one ending mid-block,
# one whose prefix is shorter than a key tile), a single-token decode row
Q_LENS = [19, 7, 1, 40, 32, 3]
PREFIX = [0, 30, 25, 9, 0, 70]


@pytest.mark.parametrize("dtype,hq,hkv,d,tile,use_work,skip_decode", [
    (torch.float32, 4, 4, 64, (16, 16, 4, 2), True, True),     # GQA group 1
    (torch.bfloat16, 8, 2, 128, (32, 16, 4, 2), True, False),  # group 4, D 128, the decode row as a 1-row prefill
    (torch.float32, 4, 1, 48, (16, 32, 4, 2), False, True),    # padded head dim, key tile wider than the query tile
    (torch.bfloat16, 4, 1, 64, (64, 32, 4, 3), False, False),  # query tile longer than most chunks
    (torch.float32, 2, 2, 32, (128, 64, 8, 3), True, True),    # the H200 tile
])
def test_prefill_v2_matches_reference(dtype: torch.dtype, hq: int, hkv: int, d: int,
                                      tile: tuple[int, int, int, int], use_work: bool, skip_decode: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    seq_lens = [p + q for p, q in zip(PREFIX, Q_LENS, strict=True)]
    batch = make_batch(gen, seq_lens, Q_LENS, hq=hq, hkv=hkv, d=d, block_size=8, dtype=dtype)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    bm, bn, warps, stages = tile
    out = torch.full_like(batch.q, float("nan"))   # poison: every served row must be written
    qsl = batch.query_start_loc.tolist()
    work = prefill_work(qsl, bm, skip_decode, "cpu", seq_lens) if use_work else None
    prefill_attention_v2(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                         batch.max_query_len, d ** -0.5, out, skip_decode=skip_decode, block_m=bm, block_n=bn,
                         work=work, num_warps=warps, num_stages=stages)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, d ** -0.5)
    decode_row = qsl[Q_LENS.index(1)]
    served = torch.ones(batch.q.shape[0], dtype=torch.bool)
    if skip_decode:
        assert torch.isnan(out[decode_row]).all()   # left to the decode kernel
        served[decode_row] = False
    assert rel_err(out[served], ref[served]) < TOL[dtype]


@pytest.mark.parametrize("dtype,skip_decode,tma", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                   (torch.float32, True, True), (torch.bfloat16, False, True)])
def test_prefill_v2_reads_new_tokens_from_contiguous_kv(dtype: torch.dtype, skip_decode: bool, tma: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # fresh prompts (one shorter than a key tile) beside chunks over cached prefixes (one a whole number of key
    # tiles, one not) and a decode row
    q_lens, prefix = [19, 40, 12, 5, 21, 1], [0, 0, 30, 0, 32, 44]
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    batch = make_batch(gen, seq_lens, q_lens, hq=8, hkv=2, d=32, block_size=4, dtype=dtype)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 0.2)
    # v a view with padded rows (the split of a fused qkv projection), k contiguous (as after Qwen3's k-norm)
    kv = torch.randn(batch.q.shape[0], 2, 3, 32, generator=gen).to(dtype)
    kv[:, 1, :2] = batch.v
    k, v = batch.k.clone(), kv[:, 1, :2]
    # the step's own keys must come from k/v, not from the cache (the decode row's too, when the prefill serves it)
    batch.kv_cache.view(2, -1, 2, 32)[:, batch.slot_mapping] = float("nan")
    out = torch.full_like(batch.q, float("nan"))
    work = prefill_work(batch.query_start_loc.tolist(), 16, skip_decode, "cpu", seq_lens)
    prefill_attention_v2(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                         batch.max_query_len, 0.2, out, skip_decode=skip_decode, block_m=16, block_n=16,
                         work=work, k=k, v=v, kv_tma=tma)
    n = sum(q_lens) - (1 if skip_decode else 0)   # the decode row last
    assert rel_err(out[:n], ref[:n]) < TOL[dtype]
    assert torch.isnan(out[-1]).all() == skip_decode


def test_work_list_heaviest_first() -> None:
    # sequence 0: 40 fresh tokens (tiles of 16: 16, 32, 40 keys); 1: decode; 2: 20 tokens after 30 cached (46, 50)
    work = prefill_work([0, 40, 41, 61], 16, True, "cpu", [40, 90, 50])
    assert work.tolist() == [[2, 1], [2, 0], [0, 2], [0, 1], [0, 0]]
    assert prefill_work([0, 40, 41, 61], 16, True, "cpu").tolist() == [[0, 0], [0, 1], [0, 2], [2, 0], [2, 1]]


def test_prefill_v2_rejects_bad_kv() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [10], [10], hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32)
    out = torch.empty_like(batch.q)
    args = (batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, 10, 1.0, out)
    with pytest.raises(ValueError, match="^v:"):
        prefill_attention_v2(*args, k=batch.k)
    with pytest.raises(ValueError, match="^k:"):
        prefill_attention_v2(*args, k=batch.k[:, :1], v=batch.v[:, :1])
    with pytest.raises(ValueError, match="^kv_tma:"):   # heads not adjacent: no [T, Hkv * D] view for TMA
        kv = torch.zeros(2, 10, 2, 32)
        prefill_attention_v2(*args, k=kv[0, :, :, :16], v=kv[1, :, :, :16], kv_tma=True)


@pytest.mark.parametrize("dtype,block_size,tile,with_kv,skip_decode", [
    (torch.float32, 32, (16, 16, 4, 2), False, True),    # two key tiles a block, every key from the cache
    (torch.float32, 16, (32, 16, 4, 2), True, False),    # one tile a block; the new keys from k/v by TMA
    (torch.bfloat16, 32, (16, 32, 4, 2), True, True),
])
def test_prefill_v2_reads_cache_blocks_by_tma(dtype: torch.dtype, block_size: int, tile: tuple[int, int, int, int],
                                              with_kv: bool, skip_decode: bool) -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    # prefixes ending mid-block and mid-tile, one shorter than a tile, one a whole number of blocks; a decode row
    q_lens, prefix = [19, 40, 12, 5, 21, 1], [0, 37, 7, 64, 32, 44]
    seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    batch = make_batch(gen, seq_lens, q_lens, hq=8, hkv=2, d=32, block_size=block_size, dtype=dtype)
    # every slot past a sequence's end is stale: whatever a box reads there must not reach the output
    used = torch.zeros(batch.kv_cache.shape[1] * block_size, dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        for p in range(s):
            used[int(batch.block_tables[b, p // block_size]) * block_size + p % block_size] = True
    flat = batch.kv_cache.view(2, -1, 2, 32)
    flat[0, ~used] = float("nan")
    flat[1, ~used] = float("inf")
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 0.2)
    bm, bn, warps, stages = tile
    kv = {"k": batch.k, "v": batch.v} if with_kv else {}
    results = []
    # the cache loop at the launch's pipeline depth and two stages deeper (its own `tl.range` loop)
    for cache_tma, cache_stages in ((True, None), (False, None), (True, stages + 2), (False, stages + 2)):
        out = torch.full_like(batch.q, float("nan"))
        work = prefill_work(batch.query_start_loc.tolist(), bm, skip_decode, "cpu", seq_lens)
        prefill_attention_v2(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             batch.max_query_len, 0.2, out, skip_decode=skip_decode, block_m=bm, block_n=bn,
                             work=work, num_warps=warps, num_stages=stages, cache_tma=cache_tma,
                             cache_stages=cache_stages, **kv)
        results.append(out)
    n = sum(q_lens) - (1 if skip_decode else 0)   # the decode row last
    for out in results:
        assert rel_err(out[:n], ref[:n]) < TOL[dtype]
        assert torch.isnan(out[-1]).all() == skip_decode


def test_prefill_v2_cache_tma_needs_whole_tiles_in_a_block() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, [20], [20], hq=4, hkv=2, d=16, block_size=8, dtype=torch.float32)
    out = torch.empty_like(batch.q)
    with pytest.raises(ValueError, match="^cache_tma:"):   # 16-key tiles over 8-token blocks
        prefill_attention_v2(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             20, 1.0, out, block_m=16, block_n=16, cache_tma=True)
    with pytest.raises(ValueError, match="^cache_stages:"):
        prefill_attention_v2(batch.q, batch.kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                             20, 1.0, out, block_m=16, block_n=16, cache_stages=9)
