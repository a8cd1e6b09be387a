"""Fused RMSNorm, rotary embedding and SiLU-and-mul against their references."""

import pytest
import torch

from kvfleet.engine.kernels import (
    build_cos_sin_cache,
    fused_add_rms_norm,
    rms_norm,
    rms_norm_ref,
    rope_tables,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_mul_ref,
)
from kvfleet.engine.rope import rope_inv_freq

from .paged import rel_err


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


@pytest.mark.parametrize("dtype,hidden", [(torch.float32, 48), (torch.bfloat16, 64), (torch.float16, 100)])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    gen = _gen()
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out = rms_norm(x, w, 1e-6)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    # bf16: the interpreter truncates float32 -> bf16 casts (the GPU rounds), hence 2e-2
    assert rel_err(out, ref) < {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    gen = _gen()
    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    res = torch.randn(2, 5, 32, generator=gen).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, residual=res)
    if dtype == torch.float32:
        assert torch.equal(new_res, ref_res)
    assert rel_err(new_res, ref_res) < 1e-2  # interpreter truncates bf16 casts
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2e-2)


def test_rms_norm_rejects_wrong_weight() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(torch.randn(3, 8), torch.ones(8), 0.0)


def test_llama3_inv_freq_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                      rope_parameters={**scaling, "rope_theta": 500000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(got, rope_inv_freq(128, 500000.0))  # scaling changes the low frequencies


def test_rope_inv_freq_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="head_dim: must be positive and even, got 7"):
        rope_inv_freq(7, 10000.0)
    with pytest.raises(ValueError, match="rope_theta: must be > 0, got 0.0"):
        rope_inv_freq(8, 0.0)
    with pytest.raises(ValueError, match="rope_scaling: rope type 'yarn' is not supported"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("dtype,hq,hk", [(torch.float32, 4, 2), (torch.bfloat16, 6, 1)])
def test_rotary_matches_reference(dtype: torch.dtype, hq: int, hk: int) -> None:
    gen = _gen()
    d = 16
    cache = build_cos_sin_cache(rope_inv_freq(d, 10000.0), 64)
    pos = torch.randint(0, 64, (9,), generator=gen)
    qkv = torch.randn(9, hq + 2 * hk, d, generator=gen).to(dtype)  # q and k as strided views of one tensor
    q, k = qkv[:, :hq], qkv[:, hq:hq + hk]
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache)
    v_before = qkv[:, hq + hk:].clone()
    rotary_embedding(pos, q, k, cache)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(q, ref_q) < tol and rel_err(k, ref_k) < tol
    assert torch.equal(qkv[:, hq + hk:], v_before)  # V untouched


def test_rotary_reference_matches_hf_rotate_half() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = _gen()
    d = 8
    inv = rope_inv_freq(d, 10000.0)
    pos = torch.arange(5)
    q = torch.randn(5, 2, d, generator=gen)
    k = torch.randn(5, 1, d, generator=gen)
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    rq, rk = rotary_embedding_ref(pos, q, k, build_cos_sin_cache(inv, 5))
    assert torch.allclose(rq, hq[0].transpose(0, 1), atol=1e-5)
    assert torch.allclose(rk, hk[0].transpose(0, 1), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_match_the_model_layer(dtype: torch.dtype) -> None:
    from kvfleet.engine.models.layers import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(128, 500000.0, scaling)
    positions = torch.cat([torch.arange(5), torch.randint(5, 130000, (6,), generator=_gen())])
    cos, sin = rope_tables(positions, rope.inv_freq, dtype)
    ref_cos, ref_sin = rope(positions, dtype)   # the torch ops on CPU
    assert cos.dtype == dtype and cos.shape == (11, 128)
    # float32: both are float32 cos/sin of the same float32 angles; bf16: the same values rounded
    atol = 1e-6 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(cos, ref_cos, atol=atol, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=atol, rtol=0)
    assert rope_tables(positions[:0], rope.inv_freq, dtype)[0].shape == (0, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    gen = _gen()
    x = torch.randn(5, 2 * 1100, generator=gen).to(dtype)  # two column blocks, the second partial
    out = silu_and_mul(x)
    ref = silu_mul_ref(x[:, :1100], x[:, 1100:])
    assert out.shape == (5, 1100)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2e-2)


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.randn(2, 7))
