"""A mixed step's decode rows split by their own count and lengths, on a GPU (the `gpu` tests: `pytest -m gpu`;
tests/engine_kernels checks the same under Triton's interpreter at small sizes)."""

from typing import Any

import pytest
import torch


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_long_prompt_steps_decode_rows_split_as_the_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lease 25's long-prompt shape at Llama-3.1-8B's heads in bf16: a 2,048-token chunk beside two decode rows of
    6,000 and 3,000 keys. Split (the default) and unsplit (KVFLEET_MIXED_DECODE_SPLITS=1) both match the torch op."""
    from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention, triton_backend
    from kvfleet.engine.kernels import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(7)
    q_lens, seq_lens, block = [1, 2048, 1], [6000, 4096, 3000], 16
    blocks = [-(-s // block) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 4, generator=gen, device="cuda").tolist()
    tables = [perm[sum(blocks[:i]):sum(blocks[:i + 1])] for i in range(len(blocks))]
    t = sum(q_lens)
    cache = torch.randn(2, len(perm), block, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(t, 32, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(t, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(t, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    outs = {}
    for max_splits in (16, 1):
        monkeypatch.setattr(paged_decode, "MIXED_MAX_SPLITS", max_splits)
        md = build_attention_metadata(q_lens, seq_lens, tables, block, "cuda")
        c = cache.clone()
        outs[max_splits] = triton_backend.triton_paged_attention(q.clone(), k, v, c, md, 128 ** -0.5)
        plan = md.plans["triton_prefill"]
        assert isinstance(plan, triton_backend.PrefillPlan)
        assert (plan.decode_splits > 1) == (max_splits > 1)
    md = build_attention_metadata(q_lens, seq_lens, tables, block, "cuda")
    ref = torch_paged_attention(q.clone(), k, v, cache.clone(), md, 128 ** -0.5)
    decode_rows = [0, 2049]
    for max_splits, out in outs.items():
        assert _rel_err(out, ref) < 2e-2, max_splits
        assert _rel_err(out[decode_rows], ref[decode_rows]) < 2e-2, max_splits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_long_prompts_give_the_same_tokens_with_the_mixed_split_on_and_off(tiny_model_factory: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight prompts of 1,500 tokens in 2,048-token eager steps: each chunk step carries the earlier prompts' decode
    rows. Greedy tokens identical with those rows split and unsplit (float32)."""
    from kvfleet.engine import LLM, SamplingParams
    from kvfleet.engine.kernels import paged_decode

    folder = str(tiny_model_factory("llama", max_position_embeddings=2048))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (1500,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw: dict[str, Any] = dict(dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=2048,
                              max_model_len=1600, gpu_memory_utilization=0.3, enforce_eager=True)
    tokens = {}
    for max_splits in (16, 1):
        monkeypatch.setattr(paged_decode, "MIXED_MAX_SPLITS", max_splits)
        llm = LLM(folder, **kw)
        tokens[max_splits] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert tokens[16] == tokens[1]
