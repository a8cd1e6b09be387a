"""The Triton attention op against the torch reference op on the same metadata."""

import dataclasses
import functools
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention, triton_backend
from kvfleet.engine.attention.fresh_prompts import fresh_long_prompts, long_prefix_chunks
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_backend import (
    gluon_min_query_tokens,
    gluon_page_loads_choice,
    gluon_schedule_choice,
    prefill_cache_extra_stages,
    prefill_kernel_choice,
    triton_paged_attention,
)
from kvfleet.engine.head_norm import QKNorm
from kvfleet.engine.kernels import apply_rotary_cos_sin
from kvfleet.engine.kernels.prefill_attention import prefill_work_pairs
from kvfleet.engine.kernels.prefill_attention_gluon import GLUON_SCHEDULES, engine_tiles, gluon_applies
from kvfleet.engine.models.layers import RotaryEmbedding, apply_rotary
from kvfleet.engine.rope import Rotary

from .paged import metadata_step as _step
from .paged import rel_err


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 1], [9, 40, 3]),            # pure decode (split-K chosen by the backend)
    ([12, 5], [12, 30]),                # fresh prefill + chunk after a cached prefix
    ([1, 7, 1, 20], [33, 7, 2, 50]),    # mixed: both kernels in one step
    ([40, 1, 17], [40, 9, 90]),         # wide tile (over 16 tokens), mixed
    ([33, 20], [33, 20]),               # fresh prompts only
])
@pytest.mark.parametrize("rotary", ["none", "fused", "separate"])
@pytest.mark.parametrize("kernel", ["v1", "v2", "v2-paged"])
def test_triton_op_matches_torch_op(q_lens: list[int], seq_lens: list[int], rotary: str, kernel: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    rope = None
    if rotary != "none":
        positions = torch.tensor([p for ql, s in zip(q_lens, seq_lens, strict=True) for p in range(s - ql, s)])
        rope = Rotary(*RotaryEmbedding(16, 10000.0)(positions, torch.float32))
        monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", rotary == "fused")
    cache_ref, q_ref, k_ref = cache.clone(), q.clone(), k.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25, rotary=rope)
    ref = torch_paged_attention(q_ref, k_ref, v, cache_ref, md, 0.25, rotary=rope)
    assert rel_err(cache, cache_ref) < 1e-6
    assert rel_err(out, ref) < 1e-5
    if max(q_lens) > 1:
        assert md.plans["triton_prefill"].kernel == kernel   # type: ignore[attr-defined]


@pytest.mark.parametrize("rotary", ["fused", "separate"])
def test_triton_op_normalises_q_and_k_heads_as_the_torch_op(rotary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's per-head q/k norm handed to the op: in the fused kernel, or by the norm kernel before the rotary
    one; the same output and cache as the torch op's, and far from the op without the norm."""
    monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", rotary == "fused")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q_lens, seq_lens = [1, 7, 1, 20], [33, 7, 2, 50]
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    positions = torch.tensor([p for ql, s in zip(q_lens, seq_lens, strict=True) for p in range(s - ql, s)])
    rope = Rotary(*RotaryEmbedding(16, 10000.0)(positions, torch.float32))
    norm = QKNorm(torch.rand(16, generator=gen) + 0.5, torch.rand(16, generator=gen) * 2, 1e-6)
    cache_ref, q_ref, k_ref = cache.clone(), q.clone(), k.clone()
    plain = torch_paged_attention(q.clone(), k.clone(), v, cache.clone(), md, 0.25, rotary=rope)
    out = triton_paged_attention(q, k, v, cache, md, 0.25, rotary=rope, qk_norm=norm)
    ref = torch_paged_attention(q_ref, k_ref, v, cache_ref, md, 0.25, rotary=rope, qk_norm=norm)
    assert rel_err(cache, cache_ref) < 1e-6
    assert rel_err(out, ref) < 1e-5
    assert rel_err(plain, ref) > 1e-2


def test_prefill_kernel_choice() -> None:
    assert prefill_kernel_choice("") == "gluon-chunks" and prefill_kernel_choice(" v1 ") == "v1"
    assert prefill_kernel_choice("v2") == "v2"
    assert prefill_kernel_choice("v2-paged") == "v2-paged" and prefill_kernel_choice("gluon") == "gluon"
    assert prefill_kernel_choice("gluon-chunks") == "gluon-chunks"
    with pytest.raises(ValueError, match="KVFLEET_PREFILL_KERNEL"):
        prefill_kernel_choice("v3")


def test_gluon_min_query_tokens() -> None:
    assert gluon_min_query_tokens("") == 2048 and gluon_min_query_tokens(" 1024 ") == 1024
    for bad in ("64", "1k"):
        with pytest.raises(ValueError, match="^KVFLEET_GLUON_MIN_QUERY_TOKENS: expected an integer >= 128"):
            gluon_min_query_tokens(bad)


def test_gluon_page_loads_choice() -> None:
    assert gluon_page_loads_choice("") == "per-copy" and gluon_page_loads_choice(" per-tile ") == "per-tile"
    with pytest.raises(ValueError, match="^KVFLEET_GLUON_PAGE_LOADS: expected per-copy or per-tile"):
        gluon_page_loads_choice("at-once")


def test_gluon_schedule_choice() -> None:
    assert gluon_schedule_choice("") == "two-warpgroups" and gluon_schedule_choice(" pingpong ") == "pingpong"
    assert gluon_schedule_choice("fa3") == "fa3"
    with pytest.raises(ValueError, match="^KVFLEET_GLUON_SCHEDULE: expected one of two-warpgroups, pingpong, fa3"):
        gluon_schedule_choice("ping-pong")


@pytest.mark.parametrize("setting", ["KVFLEET_GLUON_SCHEDULE=ping-pong", "KVFLEET_PREFILL_KERNEL=v3"])
def test_a_wrong_kernel_setting_stops_the_engine_naming_it(setting: str) -> None:
    """A mistyped KVFLEET_* setting of the kernels is an error naming it where the engine picks its attention, not
    a warning and a silent fall back to the torch path (a fresh process: the settings are read at import)."""
    name, value = setting.split("=")
    code = "from kvfleet.engine.attention import get_attention_backend; get_attention_backend('cpu')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")} | {name: value}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and f"EnvSettingError: {name}: expected" in proc.stderr, proc.stderr[-2000:]
    del env[name]
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=300).returncode == 0


def test_fresh_long_prompts_and_work_lists_for_them() -> None:
    qsl, seq_lens = [0, 40, 41, 61, 94, 96], [40, 9, 50, 33, 2]
    assert fresh_long_prompts(qsl, seq_lens, min_tokens=16) == [True, False, False, True, False]
    assert fresh_long_prompts(qsl, seq_lens, min_tokens=34) == [True, False, False, False, False]
    assert fresh_long_prompts(qsl, seq_lens, min_tokens=1) == [True, False, False, True, True]   # never decode rows
    assert fresh_long_prompts([0, 5000], [5000]) == [True] and fresh_long_prompts([0, 2047], [2047]) == [False]
    only = [True, False, False, True, False]
    pairs = prefill_work_pairs(qsl, 16, True, seq_lens, only=only)
    assert sorted(set(pairs[0::2])) == [0, 3] and len(pairs) // 2 == 3 + 3
    rest = prefill_work_pairs(qsl, 16, True, seq_lens, only=[not x for x in only])
    assert sorted(set(rest[0::2])) == [2, 4] and len(rest) // 2 == 2 + 1


def test_long_prefix_chunks() -> None:
    # a fresh prompt, a decode row, a short chunk, a long chunk over a cached prefix, a chunk in a short sequence
    qsl, seq_lens = [0, 40, 41, 47, 87, 127], [40, 90, 60, 100, 45]
    assert long_prefix_chunks(qsl, seq_lens, min_query=8, min_keys=50) == [False, False, False, True, False]
    assert long_prefix_chunks(qsl, seq_lens, min_query=6, min_keys=46) == [False, False, True, True, False]
    assert long_prefix_chunks(qsl, seq_lens, min_query=1, min_keys=1) == [False, False, True, True, True]
    assert long_prefix_chunks([0, 3000], [7000]) == [True] and long_prefix_chunks([0, 127], [7000]) == [False]
    assert long_prefix_chunks([0, 1000], [2047]) == [False] and long_prefix_chunks([0, 3000], [3000]) == [False]


def _causal_attention_of(work: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         qsl: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """What the Gluon kernel computes, in torch: each listed prompt's rows attend causally to its own k/v rows."""
    group = q.shape[1] // k.shape[1]
    for b in sorted(set(work[:, 0].tolist())):
        s, e = int(qsl[b]), int(qsl[b + 1])
        kk, vv = (x[s:e].repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), kk.float()) * scale
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv.float()).to(out.dtype)


def _rotated_step_matches_torch(q_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """A random step through the Triton op with rotary fused or not (as patched): its cache and output equal the
    torch op's on the same inputs; -> its metadata (the plan the op made is in ``plans``)."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    positions = torch.tensor([p for ql, s in zip(q_lens, seq_lens, strict=True) for p in range(s - ql, s)])
    rope = Rotary(*RotaryEmbedding(16, 10000.0)(positions, torch.float32))
    cache_ref, q_ref, k_ref = cache.clone(), q.clone(), k.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25, rotary=rope)
    ref = torch_paged_attention(q_ref, k_ref, v, cache_ref, md, 0.25, rotary=rope)
    assert rel_err(cache, cache_ref) < 1e-6
    assert rel_err(out, ref) < 1e-5
    return md


@pytest.mark.parametrize("rotary", ["fused", "separate"])
def test_gluon_choice_takes_fresh_long_prompts_and_v2_the_rest(rotary: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLEET_PREFILL_KERNEL=gluon: the fresh prompts over the threshold go to the Gluon kernel (a torch stand-in
    here: Gluon has no CPU interpreter; `bench/gpu_gluon_attention_check.py` checks the kernel on an H200), with k
    rotated in place first; the chunk over a cached prefix and the decode row to v2 and the decode kernel. The step
    equals the torch op."""
    calls: list[torch.Tensor] = []

    def gluon_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: torch.Tensor, max_query_len: int,
                       scale: float, out: torch.Tensor, work: torch.Tensor, **tile: Any) -> torch.Tensor:
        assert tile["block_m"] == 128 and not tile["s_ahead"]
        calls.append(work.clone())
        _causal_attention_of(work, q, k, v, qsl, scale, out)
        return out

    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", "gluon")
    monkeypatch.setattr(triton_backend, "gluon_applies", lambda q, k, v: True)
    monkeypatch.setattr(triton_backend, "prefill_attention_gluon", gluon_stand_in)
    monkeypatch.setattr(triton_backend, "GLUON_MIN_QUERY", 16)
    monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", rotary == "fused")
    # v2 reads the fresh keys through the cache here, so only the Gluon kernel needs k rotated in place
    monkeypatch.setattr(triton_backend, "tma_applies", lambda k, v, block_n: False)
    md = _rotated_step_matches_torch([40, 1, 20, 33, 6], [40, 9, 50, 33, 6])
    plan = md.plans["triton_prefill"]
    assert isinstance(plan, triton_backend.PrefillPlan) and plan.kernel == "v2" and plan.gluon_work is not None
    assert len(calls) == 1 and sorted(set(calls[0][:, 0].tolist())) == [0, 3]
    assert sorted(set(plan.work[:, 0].tolist())) == [2, 4]


def _chunk_attention_of(work: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, qsl: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """What the Gluon kernel's paged form computes, in torch: each listed sequence's query rows (its last tokens)
    attend causally to all its keys, read from the cache through its block table."""
    group, bs = q.shape[1] // kv_cache.shape[3], kv_cache.shape[2]
    for b in sorted(set(work[:, 0].tolist())):
        s, e, n = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        blocks = block_tables[b, :-(-n // bs)].long()
        kk, vv = (kv_cache[i, blocks].reshape(-1, *kv_cache.shape[3:])[:n].repeat_interleave(group, dim=1)
                  for i in (0, 1))
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), kk.float()) * scale
        cached = n - (e - s)
        hidden = torch.ones(e - s, n, dtype=torch.bool).triu(cached + 1)
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                                vv.float()).to(out.dtype)


@pytest.mark.parametrize(("schedule", "page_loads"), [(s, "per-copy") for s in GLUON_SCHEDULES]
                         + [("two-warpgroups", "per-tile")])
def test_gluon_chunks_choice_takes_long_chunks_over_a_cached_prefix(monkeypatch: pytest.MonkeyPatch,
                                                                    schedule: str, page_loads: str) -> None:
    """KVFLEET_PREFILL_KERNEL=gluon-chunks: the fresh long prompts to the Gluon kernel, the long chunks over a cached
    prefix to its paged form (torch stand-ins for both: no CPU interpreter; `bench/gpu_gluon_engine_check.py` checks
    them on an H200), which reads the chunk's own keys from the cache, rotated as written; the short chunk and
    the decode row to v2 and the decode kernel. The step equals the torch op. Each KVFLEET_GLUON_SCHEDULE hands
    both kernels its tiles (`engine_tiles`)."""
    fresh_calls: list[torch.Tensor] = []
    chunk_calls: list[torch.Tensor] = []
    fresh_tile, chunk_tile = engine_tiles(gluon_schedule_choice(schedule),
                                          pages_at_once=gluon_page_loads_choice(page_loads) == "per-tile")
    assert chunk_tile.pages_at_once == (page_loads == "per-tile") and not fresh_tile.pages_at_once

    def gluon_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: torch.Tensor, max_query_len: int,
                       scale: float, out: torch.Tensor, work: torch.Tensor, **tile: Any) -> torch.Tensor:
        assert tile == dataclasses.asdict(fresh_tile)
        fresh_calls.append(work.clone())
        _causal_attention_of(work, q, k, v, qsl, scale, out)
        return out

    def paged_stand_in(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       qsl: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor, work: torch.Tensor,
                       **tile: Any) -> torch.Tensor:
        assert tile == dataclasses.asdict(chunk_tile) and tile["block_m"] == 128 and tile["warp_specialize"]
        chunk_calls.append(work.clone())
        _chunk_attention_of(work, q, kv_cache, block_tables, seq_lens, qsl, scale, out)
        return out

    monkeypatch.setattr(triton_backend, "GLUON_TILE", fresh_tile)
    monkeypatch.setattr(triton_backend, "GLUON_CHUNK_TILE", chunk_tile)
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", "gluon-chunks")
    monkeypatch.setattr(triton_backend, "gluon_applies", lambda q, k, v: True)
    monkeypatch.setattr(triton_backend, "paged_applies", lambda kv_cache, block_n: True)
    monkeypatch.setattr(triton_backend, "prefill_attention_gluon", gluon_stand_in)
    monkeypatch.setattr(triton_backend, "prefill_attention_gluon_paged", paged_stand_in)
    monkeypatch.setattr(triton_backend, "GLUON_MIN_QUERY", 16)
    monkeypatch.setattr(triton_backend, "long_prefix_chunks",
                        functools.partial(long_prefix_chunks, min_query=16, min_keys=40))
    monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", True)
    monkeypatch.setattr(triton_backend, "tma_applies", lambda k, v, block_n: False)
    # fresh long, decode, long chunk over 30 cached, short chunk, chunk in a short sequence, fresh short
    md = _rotated_step_matches_torch([40, 1, 20, 5, 17, 6], [40, 9, 50, 60, 30, 6])
    plan = md.plans["triton_prefill"]
    assert isinstance(plan, triton_backend.PrefillPlan) and plan.gluon_chunk_work is not None
    assert len(fresh_calls) == 1 and sorted(set(fresh_calls[0][:, 0].tolist())) == [0]
    assert len(chunk_calls) == 1 and sorted(set(chunk_calls[0][:, 0].tolist())) == [2]
    assert sorted(set(plan.work[:, 0].tolist())) == [3, 4, 5]


def test_gluon_chunks_choice_keeps_chunks_on_v2_without_a_paged_cache_it_reads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `paged_applies` refuses the cache (blocks as long as the key tile, say), "gluon-chunks" is "gluon"."""
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", "gluon-chunks")
    monkeypatch.setattr(triton_backend, "gluon_applies", lambda q, k, v: True)
    monkeypatch.setattr(triton_backend, "long_prefix_chunks",
                        functools.partial(long_prefix_chunks, min_query=16, min_keys=40))
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, [20, 1], [50, 9])
    plan = triton_backend._prefill_plan(md, q, k, v, cache)   # float32 cache of 8-token blocks: not Gluon's
    assert plan.gluon_chunk_work is None and plan.gluon_work is None
    assert sorted(set(plan.work[:, 0].tolist())) == [0]


def test_gluon_choice_falls_back_to_v2_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU (or any tensors `gluon_applies` refuses) the gluon choice is plain v2, and exact."""
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", "gluon")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, [40, 1, 33], [40, 9, 33])
    assert not gluon_applies(q, k, v)
    cache_ref, q_ref = cache.clone(), q.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25)
    ref = torch_paged_attention(q_ref, k, v, cache_ref, md, 0.25)
    assert rel_err(out, ref) < 1e-5
    plan = md.plans["triton_prefill"]
    assert isinstance(plan, triton_backend.PrefillPlan) and plan.kernel == "v2" and plan.gluon_work is None
    captured = triton_backend.CapturedPrefill(128, 4, torch.float32, torch.device("cpu"))
    assert captured.kernel == "v2" and captured.plan(128).gluon_work is None   # graphs replay v2 alone


def test_prefill_cache_extra_stages_knob() -> None:
    assert prefill_cache_extra_stages("") == 2 and prefill_cache_extra_stages(" 0 ") == 0
    for bad in ("-1", "5", "two"):
        with pytest.raises(ValueError, match="KVFLEET_PREFILL_CACHE_EXTRA_STAGES"):
            prefill_cache_extra_stages(bad)


def test_short_prefill_tile_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLEET_PREFILL_TILE_SHORT takes steps whose longest query is 17..2048 tokens, and the op stays exact."""
    monkeypatch.setenv("KVFLEET_PREFILL_TILE_SHORT", "16,16,4,2")
    f32 = torch.float32
    assert triton_backend._prefill_tile("v2", 40, f32) == (16, 16, 4, 2)
    assert triton_backend._prefill_tile("v2", 2048, f32) == (16, 16, 4, 2)
    assert triton_backend._prefill_tile("v2", 2049, f32) == triton_backend.default_tile_v2(2049, f32)
    assert triton_backend._prefill_tile("v2", 16, f32) == triton_backend.default_tile_v2(16, f32)
    gen = torch.Generator().manual_seed(3)
    q, k, v, cache, md = _step(gen, [40, 1, 17], [40, 9, 90])
    cache_ref, q_ref, k_ref = cache.clone(), q.clone(), k.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25)
    ref = torch_paged_attention(q_ref, k_ref, v, cache_ref, md, 0.25)
    assert md.plans["triton_prefill"].tile == (16, 16, 4, 2)   # type: ignore[attr-defined]
    assert rel_err(out, ref) < 1e-5
    monkeypatch.setenv("KVFLEET_PREFILL_TILE_SHORT", "16,16")
    triton_backend.prefill_tile.cache_clear()
    with pytest.raises(ValueError, match="KVFLEET_PREFILL_TILE_SHORT"):
        triton_backend._prefill_tile("v2", 40, f32)


def test_rotary_cos_sin_matches_model_layer() -> None:
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(16, 500000.0, scaling)
    positions = torch.randint(0, 500, (6,), generator=gen)
    cos, sin = rope(positions, torch.float32)
    q = torch.randn(6, 4, 16, generator=gen)
    k = torch.randn(6, 2, 16, generator=gen)
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    apply_rotary_cos_sin(q, k, cos, sin)
    assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6


@pytest.mark.parametrize("arch,rotary_cache,merge,kernel,block,extra_stages", [
    ("llama", True, "fused", "v1", 16, 0), ("qwen3", True, "fused", "v1", 16, 0),
    ("llama", False, "kernel", "v1", 16, 0),
    ("llama", True, "fused", "v2", 16, 0),   # the prefill reads its fresh K/V from k, rotated in place by the fused
                                             # kernel
    ("qwen3", True, "fused", "v2", 16, 0),   # ... normalised there too (Qwen3's q/k norm)
    ("qwen3", False, "fused", "v2", 16, 0),  # ... normalised by the norm kernel, rotated by the rotary kernel
    ("qwen3-norms-in-model", True, "fused", "v2", 16, 0),   # KVFLEET_FUSED_QK_NORM=0: the model's own norms
    ("llama", True, "fused", "v2", 32, 0),   # 32-token blocks: the second chunk's cached keys come a block by TMA
    ("llama", True, "fused", "v2", 16, 2),   # two chunks, the loop over the cached keys two stages deeper
])
def test_model_on_triton_op_matches_transformers(arch: str, rotary_cache: bool, merge: str, kernel: str, block: int,
                                                 extra_stages: int, tiny_model_factory: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The model over the Triton op (rotary fused with the cache write; split decode steps, their partials
    merged by the last split program) gives transformers' logits: a 70-token prefill (in two chunks with
    32-token blocks), then 10 decode steps."""
    import transformers

    from kvfleet.engine.kernels import paged_decode
    from kvfleet.engine.model_config import ModelConfig
    from kvfleet.engine.model_loader import load_model
    from kvfleet.engine.models import llama

    if arch == "qwen3-norms-in-model":
        arch = "qwen3"
        monkeypatch.setattr(llama, "FUSED_QK_NORM", False)
    monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", rotary_cache)
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel)
    monkeypatch.setattr(triton_backend, "PREFILL_CACHE_EXTRA_STAGES", extra_stages)
    monkeypatch.setattr(paged_decode, "DEFAULT_MERGE", merge)
    folder = tiny_model_factory(arch)
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(cfg, device="cpu")
    for layer in model.model.layers:
        layer.self_attn.attention_fn = triton_paged_attention
    tokens = torch.randint(3, cfg.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    caches = [torch.zeros(2, 8, block, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    table = [5, 2, 7, 0, 3, 6]   # shuffled physical blocks
    got = []
    chunked = block != 16 or extra_stages > 0
    prefill = [(0, 45), (45, 70)] if chunked else [(0, 70)]
    for start, end in prefill + [(p, p + 1) for p in range(70, 80)]:
        md = build_attention_metadata([end - start], [end], [table], block)
        with torch.no_grad():
            hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches, md)
            got.append(model.compute_logits(hidden)[-1])
    if chunked:
        got.pop(0)   # the first chunk's last logits: position 44, not compared
    ours = torch.stack(got)
    want = ref[69:80]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def _decode_calls_of_a_step_as_the_torch_op(monkeypatch: pytest.MonkeyPatch, q_lens: list[int], seq_lens: list[int]
                                            ) -> tuple[list[dict[str, Any]], AttentionMetadata]:
    """Run a random step through the Triton op, check it against the torch op; -> the keyword arguments of its
    decode kernel launches, and its metadata (with the step's plans)."""
    calls: list[dict[str, Any]] = []
    real = triton_backend.paged_decode_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    cache_ref, q_ref = cache.clone(), q.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25)
    ref = torch_paged_attention(q_ref, k, v, cache_ref, md, 0.25)
    assert rel_err(out, ref) < 1e-5
    return calls, md


def test_triton_op_splits_long_decode_contexts_with_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLEET_DECODE_LONG_SPLIT: a decode step whose contexts may exceed the threshold launches two splits; the
    sequences within it are written whole by split 0, the others merged; all as the torch op."""
    from kvfleet.engine.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "DEFAULT_LONG_SPLIT", 64)   # contexts over 64 keys: two splits
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 1)   # the batch alone asks for one split
    calls, _ = _decode_calls_of_a_step_as_the_torch_op(monkeypatch, [1, 1, 1, 1], [9, 70, 31, 90])
    assert calls[0]["num_splits"] == 2 and calls[0]["direct_single"] and calls[0]["split_tokens"] == 64


@pytest.mark.parametrize("max_splits,want", [(16, 4), (2, 2), (1, 1)])
def test_a_mixed_steps_few_long_decodes_are_split(monkeypatch: pytest.MonkeyPatch, max_splits: int,
                                                   want: int) -> None:
    """The decode rows of a mixed step get the split count of their own count and lengths (one row of 400 keys, 2
    KV heads, 4 "SMs" on a CPU: 4 splits), at most KVFLEET_MIXED_DECODE_SPLITS; as the torch op either way."""
    from kvfleet.engine.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "MIXED_MAX_SPLITS", max_splits)
    calls, md = _decode_calls_of_a_step_as_the_torch_op(monkeypatch, [1, 30, 5], [400, 30, 60])
    assert [c["num_splits"] for c in calls] == [want]
    assert md.plans["triton_prefill"].decode_splits == want   # type: ignore[attr-defined]
