"""Penalties through the whole engine (not just the sampler) against references on the same weights:
repetition_penalty against transformers' own `generate(repetition_penalty=...)`; presence and
frequency penalties (OpenAI semantics, output tokens only) against a greedy loop over the
transformers model that applies them by hand. Each case is checked to change the tokens, so a
penalty the engine dropped could not pass."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def case(tiny_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, hf.config.vocab_size, (6,), generator=g).tolist()
    prompts = [base * 3, base[:4] * 5 + [7]]          # repeated tokens: penalties have something to bite on
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=16)   # chunked prefill too
    return hf, llm, prompts


def engine_greedy(llm: LLM, prompts: list[list[int]], **penalty: float) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, **penalty)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def hf_reference(hf, prompt: list[int], presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            for tok, count in Counter(out).items():
                logits[tok] -= frequency * count + presence
            logits[hf.config.eos_token_id] = -float("inf")   # min_tokens = max_tokens
            out.append(int(logits.argmax()))
    return out


def test_repetition_penalty_matches_transformers(case) -> None:
    hf, llm, prompts = case
    plain = engine_greedy(llm, prompts)
    got = engine_greedy(llm, prompts, repetition_penalty=1.8)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                           repetition_penalty=1.8, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == ref
    assert got != plain


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (-1.0, 0.5)])
def test_presence_and_frequency_penalties_match_a_reference_loop(case, presence: float, frequency: float) -> None:
    hf, llm, prompts = case
    plain = engine_greedy(llm, prompts)
    got = engine_greedy(llm, prompts, presence_penalty=presence, frequency_penalty=frequency)
    assert got == [hf_reference(hf, p, presence, frequency) for p in prompts]
    assert got != plain
    # The same request alone and beside an unpenalized one: penalties are per row.
    mixed = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW,
                                                  presence_penalty=presence, frequency_penalty=frequency),
                                   SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)])
    assert [o.outputs[0].token_ids for o in mixed] == [got[0], plain[1]]
