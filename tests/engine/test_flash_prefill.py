"""The flash prefill path's plumbing (KVFLEET_PREFILL_ATTENTION=flash) on CPU: which rows, which keys (cached
prefix gathered through the block table, or the new tokens alone), causal alignment to the last key, and the
scatter back, with a plain-PyTorch varlen attention standing in for PyTorch's FlashAttention-2 kernel (CUDA
only; bench/gpu_profile_issue16.py checks the real one against a float32 reference on the GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention
from kvfleet.engine.attention.flash_prefill import flash_plan, flash_prefill, prefill_impl, varlen_causal_reference
from kvfleet.engine.attention.triton_backend import prefill_tile


def _case(q_lens: list[int], ctx: list[int], hq: int = 8, hkv: int = 2, d: int = 16, bs: int = 4,
          seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    nb = [math.ceil(s / bs) for s in seq]
    perm = torch.randperm(sum(nb) + 3, generator=g).tolist()   # blocks scattered through the pool
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n])
        i += n
    md = build_attention_metadata(q_lens, seq, tables, bs, "cpu")
    t = sum(q_lens)
    return {"md": md, "cache": torch.randn(2, sum(nb) + 3, bs, hkv, d, generator=g),
            "q": torch.randn(t, hq, d, generator=g), "k": torch.randn(t, hkv, d, generator=g),
            "v": torch.randn(t, hkv, d, generator=g), "q_lens": q_lens, "bs": bs}


@pytest.mark.parametrize("q_lens,ctx", [
    ([7, 1, 12, 1, 5], [0, 9, 20, 3, 0]),     # mixed: prefills with and without cached prefixes, decodes
    ([6, 9], [0, 0]),                          # prefill only, no prefix: keys are the new tokens
    ([1, 5, 1], [4, 0, 7]),                    # rows not all prefill, no prefix
    ([3, 2], [13, 30]),                        # chunks after long prefixes
])
def test_flash_path_equals_the_paged_reference(q_lens: list[int], ctx: list[int]) -> None:
    c = _case(q_lens, ctx)
    md = c["md"]
    cache = c["cache"].clone()
    ref = torch_paged_attention(c["q"], c["k"], c["v"], cache, md, 0.25)   # writes the new K/V into `cache`
    plan = flash_plan(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, c["bs"], torch.device("cpu"))
    assert plan is not None
    assert (plan.k_slots is None) == all(x == 0 for x, q in zip(ctx, q_lens, strict=True) if q > 1)
    out = torch.full_like(c["q"], float("nan"))
    flash_prefill(c["q"], c["k"], c["v"], cache, plan, 0.25, out, attn=varlen_causal_reference)
    rows = [r for b, q in enumerate(q_lens) if q > 1
            for r in range(md.query_start_loc_cpu[b], md.query_start_loc_cpu[b + 1])]
    others = [r for r in range(sum(q_lens)) if r not in rows]
    assert torch.allclose(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    assert torch.isnan(out[others]).all()   # decode rows are the decode kernel's


def test_no_prefill_rows_no_plan() -> None:
    c = _case([1, 1], [5, 8])
    md = c["md"]
    assert flash_plan(md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, c["bs"], torch.device("cpu")) is None


def test_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_PREFILL_ATTENTION", raising=False)
    assert prefill_impl() == "triton"
    monkeypatch.setenv("KVFLEET_PREFILL_ATTENTION", "flash")
    assert prefill_impl() == "flash"
    monkeypatch.setenv("KVFLEET_PREFILL_ATTENTION", "fa9")
    with pytest.raises(ValueError, match="KVFLEET_PREFILL_ATTENTION"):
        prefill_impl()
    assert prefill_tile("") is None
    assert prefill_tile("128,64,8,3") == (128, 64, 8, 3)
    for bad in ("128,64,8", "100,64,8,3", "a,b,c,d"):
        with pytest.raises(ValueError, match="KVFLEET_PREFILL_TILE"):
            prefill_tile(bad)


def test_gqa_heads_expanded_if_the_kernel_refuses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.attention.varlen as varlen

    from kvfleet.engine.attention import flash_prefill as fp

    calls: list[int] = []

    def strict_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):   # heads must match
        calls.append(k.shape[1])
        assert window_size == (-1, 0)
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("Number of heads in key/value must equal the query's")
        return varlen_causal_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    monkeypatch.setattr(varlen, "varlen_attn", strict_kernel)
    monkeypatch.setitem(fp._GQA, "native", True)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(9, 8, 16, generator=g), torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = fp.torch_varlen_attn(q, k, v, cu, cu, 5, 5, 0.25)
    assert torch.allclose(out, varlen_causal_reference(q, k, v, cu, cu, 5, 5, 0.25), atol=1e-6)
    assert calls == [2, 8] and fp._GQA["native"] is False
    fp.torch_varlen_attn(q, k, v, cu, cu, 5, 5, 0.25)
    assert calls == [2, 8, 8]   # expanded from then on, no failing call first
