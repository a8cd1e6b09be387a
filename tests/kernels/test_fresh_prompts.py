"""Fresh prompts through PyTorch's SDPA (`attention.fresh_prompts`) inside the Triton attention op."""

from typing import Any

import pytest
import torch

from kvfleet.engine.attention import fresh_prompts as fp
from kvfleet.engine.attention import torch_paged_attention, triton_backend
from kvfleet.engine.attention.triton_backend import triton_paged_attention
from kvfleet.engine.kernels.prefill_attention import prefill_work_pairs
from kvfleet.engine.models.layers import RotaryEmbedding
from kvfleet.engine.rope import Rotary

from .paged import metadata_step as _step
from .paged import rel_err


def test_config_parses_the_knobs_and_names_a_bad_one() -> None:
    assert fp.sdpa_prefill_config("") == fp.SdpaPrefillConfig(None, 1024, 256)
    assert fp.sdpa_prefill_config(" cudnn ", "2048", "128") == fp.SdpaPrefillConfig("cudnn", 2048, 128)
    with pytest.raises(ValueError, match="KVFLEET_SDPA_PREFILL:"):
        fp.sdpa_prefill_config("fa3")
    with pytest.raises(ValueError, match="KVFLEET_SDPA_PREFILL_MIN_TOKENS"):
        fp.sdpa_prefill_config("cudnn", "many")
    with pytest.raises(ValueError, match="KVFLEET_SDPA_PREFILL_BUCKET"):
        fp.sdpa_prefill_config("cudnn", "", "0")


def test_only_fresh_prompts_of_min_tokens_go_to_sdpa() -> None:
    qsl = [0, 1, 41, 61, 91, 93]          # decode, fresh 40, chunk 20 over 10 cached, fresh 30, fresh 2
    seq_lens = [50, 40, 30, 30, 2]
    on = fp.SdpaPrefillConfig("math", 30, 16)
    assert fp.fresh_prompt_seqs(qsl, seq_lens, on) == (1, 3)
    assert fp.fresh_prompt_seqs(qsl, seq_lens, fp.SdpaPrefillConfig("math", 1, 16)) == (1, 3, 4)
    assert fp.fresh_prompt_seqs(qsl, seq_lens, fp.SdpaPrefillConfig(None, 1, 16)) == ()
    # the prefill kernel's work list leaves those sequences out
    pairs = prefill_work_pairs(qsl, 16, True, seq_lens, exclude=(1, 3))
    assert sorted(set(pairs[0::2])) == [2, 4]


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([40, 1, 17, 33], [40, 9, 90, 33]),   # fresh prompts beside a decode row and a chunk over a cached prefix
    ([20, 45], [20, 45]),                 # the last prompt's bucket runs past the step's rows: zero padding
    ([1, 1], [5, 9]),                     # pure decode: nothing to do for SDPA
])
@pytest.mark.parametrize("rotary", ["fused", "separate"])
@pytest.mark.parametrize("kernel", ["v1", "v2"])
def test_op_with_sdpa_fresh_prompts_matches_torch_op(q_lens: list[int], seq_lens: list[int], rotary: str,
                                                     kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = fp.SdpaPrefillConfig("math", 16, 16)
    monkeypatch.setattr(triton_backend, "SDPA_PREFILL", config)
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel)
    monkeypatch.setattr(triton_backend, "FUSED_ROTARY_CACHE", rotary == "fused")
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    positions = torch.tensor([p for ql, s in zip(q_lens, seq_lens, strict=True) for p in range(s - ql, s)])
    rope = Rotary(*RotaryEmbedding(16, 10000.0)(positions, torch.float32))
    cache_ref, q_ref, k_ref = cache.clone(), q.clone(), k.clone()
    out = triton_paged_attention(q, k, v, cache, md, 0.25, rotary=rope)
    ref = torch_paged_attention(q_ref, k_ref, v, cache_ref, md, 0.25, rotary=rope)
    assert rel_err(cache, cache_ref) < 1e-6
    assert rel_err(out, ref) < 1e-5
    expected = fp.fresh_prompt_seqs(md.query_start_loc_cpu, md.seq_lens_cpu, config)
    if max(q_lens) > 1:
        plan: Any = md.plans["triton_prefill"]
        assert plan.fresh == expected and len(expected) > 0


def test_padding_rows_never_reach_a_real_query() -> None:
    """A prompt's bucket reads the step's next rows: garbage there (huge values) must not change its output."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(48, h, 16, generator=gen) for h in (4, 2, 2))
    out = torch.zeros(48, 4, 16)
    config = fp.SdpaPrefillConfig("math", 2, 32)
    fp.attend_fresh_prompts(q, k, v, out, [0, 20, 48], (0,), 0.25, config)
    k2, v2 = k.clone(), v.clone()
    k2[20:], v2[20:] = 1e4, -1e4
    out2 = torch.zeros(48, 4, 16)
    fp.attend_fresh_prompts(q, k2, v2, out2, [0, 20, 48], (0,), 0.25, config)
    assert torch.equal(out[:20], out2[:20])
    assert torch.count_nonzero(out2[20:]) == 0     # rows of other sequences are not written
