"""The real default model, SmolLM2-135M-Instruct (GGUF): greedy chat replies identical to
transformers' own GGUF loading of the same file, and it knows the capital of France."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
]
MAX_NEW = 16


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), max_model_len=512, num_kv_blocks=128)


def test_greedy_chat_matches_transformers_gguf(llm: LLM, smollm2_path) -> None:
    import transformers

    tok = llm.get_tokenizer()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32).eval()
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for conv, out in zip(convs, outs, strict=True):
        ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        if not isinstance(ids, list):
            ids = list(ids["input_ids"])
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, (out.outputs[0].text, tok.decode(ref))


def test_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
