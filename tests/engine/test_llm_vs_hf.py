"""Greedy tokens and logprobs of our engine against transformers on the same tiny weights.

Prompts of different lengths cross block boundaries; each arch runs with chunked prefill
(a small token budget so prompts really are chunked), without it, with prefix-cache hits,
and under forced preemption (a KV pool too small for the batch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_LENS = (3, 16, 17, 33, 41)
MAX_NEW = 10
LOGPROB_TOL = 1e-4   # float32 on CPU: same math, different kernels and summation order


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                      return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float().log_softmax(-1) for x in out.logits]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_model_factory):
    import transformers

    folder: Path = tiny_model_factory(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = prompts_for(hf.config.vocab_size)
    with torch.no_grad():
        refs = [hf_greedy(hf, p) for p in prompts]
    return folder, prompts, refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def check(outs, refs) -> None:
    for out, (ref_ids, _) in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref_ids


def test_chunked_prefill_and_prefix_cache_hits(arch_case) -> None:
    folder, prompts, refs = arch_case
    llm = LLM(str(folder), max_num_batched_tokens=16, enable_chunked_prefill=True, num_kv_blocks=64)
    check(llm.generate(prompts, GREEDY), refs)
    before = llm.stats()["prefix_cache_hits"]
    check(llm.generate(prompts, GREEDY), refs)          # the same prompts again: cached blocks
    # Full blocks of each prompt, all but the last token: 0 + 0 + 16 + 32 + 32.
    assert before == 0 and llm.stats()["prefix_cache_hits"] == 16 + 32 + 32
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0


def test_no_chunking_and_forced_preemption(arch_case) -> None:
    folder, prompts, refs = arch_case
    llm = LLM(str(folder), enable_chunked_prefill=False, max_model_len=256, block_size=8)
    check(llm.generate(prompts, GREEDY), refs)
    # Room for the longest request alone (51 tokens -> 7 blocks) but not for the batch.
    need = math.ceil((max(PROMPT_LENS) + MAX_NEW) / 8)
    small = LLM(str(folder), block_size=8, num_kv_blocks=need + 2, enable_prefix_caching=False)
    check(small.generate(prompts, GREEDY), refs)
    assert small.stats()["num_preemptions"] > 0
    assert small.stats()["kv_blocks_used"] == 0


def test_logprobs_match_transformers(tiny_model_factory) -> None:
    import transformers

    folder = tiny_model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = prompts_for(hf.config.vocab_size)[3]
    with torch.no_grad():
        ref_ids, ref_lps = hf_greedy(hf, prompt)
        prompt_lp = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    llm = LLM(str(folder), num_kv_blocks=32, max_num_batched_tokens=16)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW,
                                                logprobs=5, prompt_logprobs=3))[0]
    comp = out.outputs[0]
    assert comp.token_ids == ref_ids and len(comp.logprobs) == MAX_NEW
    for tok, lp_dict, ref in zip(comp.token_ids, comp.logprobs, ref_lps, strict=True):
        assert abs(lp_dict[tok].logprob - ref[tok].item()) < LOGPROB_TOL
        assert lp_dict[tok].rank == 1
        top_vals, top_ids = ref.topk(5)
        for v, t in zip(top_vals.tolist(), top_ids.tolist(), strict=True):
            assert abs(lp_dict[t].logprob - v) < LOGPROB_TOL
    assert abs(comp.cumulative_logprob - sum(r[t].item() for t, r in zip(ref_ids, ref_lps, strict=True))) < 1e-3
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(plp[i][prompt[i]].logprob - prompt_lp[i - 1, prompt[i]].item()) < LOGPROB_TOL
