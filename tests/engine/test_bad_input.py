"""Every bad input raises a ValueError naming the field and the limit, before the scheduler sees it."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.engine import LLM, AsyncLLM, SamplingParams
from kvfleet.engine.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=64, num_kv_blocks=40)


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: must be in \(0, 1\]"),
    (dict(temperature=-0.1), r"temperature: must be non-negative"),
    (dict(n=0), r"n: must be at least 1"),
    (dict(top_k=0), r"top_k: must be -1 \(disable\) or at least 1"),
    (dict(top_k=-2), r"top_k: must be -1"),
    (dict(min_p=1.5), r"min_p: must be in \[0, 1\]"),
    (dict(max_tokens=0), r"max_tokens: must be at least 1"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens: must be less than or equal to max_tokens=2"),
    (dict(presence_penalty=3.0), r"presence_penalty: must be in \[-2, 2\]"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty: must be in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty: must be in \(0, 2\]"),
    (dict(logprobs=-1), r"logprobs: must be non-negative"),
    (dict(n=3, best_of=2), r"best_of: must be an int >= n \(3\)"),
    (dict(stop_token_ids=[10**6]), r"stop_token_ids: must be token ids in \[0, \d+\)"),
    (dict(stop=[""]), r"stop: must be non-empty strings"),
    (dict(logit_bias={10**6: 1.0}), r"logit_bias: keys must be token ids in \[0, \d+\)"),
    (dict(logit_bias={3: 100.5}), r"logit_bias: values must be numbers in \[-100, 100\], got 100.5 for token 3"),
    (dict(logit_bias={3: float("nan")}), r"logit_bias: values must be numbers"),
    (dict(logit_bias={"3": 1.0}), r"logit_bias: keys must be token ids"),
    (dict(logit_bias=[3]), r"logit_bias: must be a map of token ids to numbers"),
    (dict(logit_bias=dict.fromkeys(range(1025), 1.0)), r"logit_bias: must have at most 1024 entries"),
    (dict(stop=["ok", "\ud800"]), r"stop: must be valid Unicode text"),
    # Wrong types and NaN are ValueErrors naming the field too (never a TypeError or a garbage step).
    (dict(temperature=float("nan")), r"temperature: must be a number, got nan"),
    (dict(temperature="0.5"), r"temperature: must be a number, got '0.5'"),
    (dict(top_p=None), r"top_p: must be a number, got None"),
    (dict(presence_penalty=True), r"presence_penalty: must be a number, got True"),
    (dict(length_penalty=float("nan")), r"length_penalty: must be a number"),
    (dict(stop=5), r"stop: must be a string or a list of strings, got 5"),
    (dict(stop_token_ids=7), r"stop_token_ids: must be a list of token ids, got 7"),
    (dict(top_k=5.0), r"top_k: must be -1 \(disable\) or at least 1, got 5.0"),
    (dict(seed=2**63), r"seed: must be in \[-2\*\*63, 2\*\*63\)"),     # used to fail the whole step
    (dict(seed=-(2**63) - 1), r"seed: must be in \[-2\*\*63, 2\*\*63\)"),
])
def test_invalid_sampling_values(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs).validate(vocab_size=512)


def test_bad_prompts_rejected_before_scheduling(llm: LLM) -> None:
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    cases = [
        ([], r"prompt: must not be empty"),
        ("", r"prompt: must not be empty"),
        ([1, 2, vocab], rf"prompt_token_ids: token id {vocab} is outside the vocabulary \[0, {vocab}\)"),
        ([1, -1], r"prompt_token_ids: token id -1 is outside the vocabulary"),
        (list(range(1, 70)), r"prompt: 69 tokens exceed max_model_len=64"),
        (list(range(1, 60)), r"max_tokens: prompt \(59 tokens\) \+ max_tokens \(16\) = 75 exceeds max_model_len=64"),
        ({"prompt_token_ids": "abc"}, r"prompt_token_ids: must be a list of ints"),
        (3.5, r"prompt: must be a string, a list of token ids or a dict"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], SamplingParams(max_tokens=16))
        assert not eng.scheduler.has_unfinished() and not eng.groups
    with pytest.raises(ValueError, match=r"top_k: must be -1"):
        llm.generate(["hello"], SamplingParams(top_k=0))
    # The widest seeds still run, with n samples (each seeded seed + i), beside another request.
    for seed in (2**63 - 1, -(2**63)):
        outs = llm.generate([[1, 2], [3, 4]], [SamplingParams(n=3, max_tokens=2, seed=seed, ignore_eos=True),
                                               SamplingParams(max_tokens=2, ignore_eos=True)])
        assert [len(c.token_ids) for o in outs for c in o.outputs] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"n: 100000 sequences exceed max_num_seqs=256"):
        llm.generate([[1, 2]], SamplingParams(n=100000))
    with pytest.raises(ValueError, match=r"best_of: 300 sequences exceed max_num_seqs=256"):
        llm.generate([[1, 2]], SamplingParams(n=2, best_of=300))
    # A batch with one bad prompt adds nothing at all.
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=4))
    assert not eng.scheduler.has_unfinished() and not eng.groups
    # The engine still serves normally afterwards.
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_request_that_can_never_fit_the_kv_pool(tiny_model_dir) -> None:
    small = LLM(str(tiny_model_dir), max_model_len=256, num_kv_blocks=3, block_size=16)
    with pytest.raises(ValueError, match=r"max_tokens: prompt \(40 tokens\) \+ max_tokens \(16\) can never fit "
                                         r"the KV cache \(48 tokens\)"):
        small.generate([list(range(1, 41))], SamplingParams(max_tokens=16))
    # A prompt that alone fills the cache is the prompt's fault, whatever max_tokens says.
    for n in (48, 60):
        with pytest.raises(ValueError, match=rf"prompt: {n} tokens leave no room to generate in the KV cache "
                                             r"\(48 tokens\)"):
            small.generate([list(range(1, n + 1))], SamplingParams(max_tokens=1))
    assert not small.llm_engine.scheduler.has_unfinished() and not small.llm_engine.groups
    assert len(small.generate([list(range(1, 47))], SamplingParams(max_tokens=2, ignore_eos=True))[0]
               .outputs[0].token_ids) == 2    # the largest request that fits still runs


def test_lone_surrogates_are_value_errors_naming_the_field(llm: LLM) -> None:
    eng = llm.llm_engine
    bad = [("a\ud800b", r"prompt: invalid Unicode text at character 1 \('\\ud800' is a lone UTF-16 surrogate\)"),
           ({"prompt": "ok \udfff"}, r"prompt: invalid Unicode text at character 3"),
           (["fine", "x\udc00"], r"prompt: invalid Unicode text")]   # a batch with one bad prompt adds nothing
    for prompts, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, SamplingParams(max_tokens=2))
        assert not eng.scheduler.has_unfinished() and not eng.groups
    with pytest.raises(ValueError, match=r"messages: invalid Unicode text at messages\[1\]\.content"):
        llm.chat([{"role": "system", "content": "hi"}, {"role": "user", "content": "a\ud800b"}])
    with pytest.raises(ValueError, match=r"messages: invalid Unicode text at messages\[1\]\[0\]\.content"):
        llm.chat([[{"role": "user", "content": "ok"}], [{"role": "user", "content": "\ud800"}]])
    with pytest.raises(ValueError, match=r"messages: invalid Unicode text at character"):   # via template kwargs
        llm.chat([{"role": "user", "content": "ok"}], chat_template="{{ extra }}{{ messages[0].content }}",
                 extra="\ud800")
    assert not eng.scheduler.has_unfinished() and not eng.groups
    # Valid non-ASCII text (astral plane too) still tokenizes.
    out = llm.generate("naïve 😀", SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("naïve 😀")


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=3), r"block_size: must be a power of two"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization: must be in \(0, 1\]"),
    (dict(max_num_seqs=0), r"max_num_seqs: must be >= 1"),
    (dict(dtype="int8"), r"dtype: must be one of"),
    (dict(load_format="pickle"), r"load_format: must be one of"),
    (dict(num_kv_blocks=0), r"num_kv_blocks: must be >= 1"),
])
def test_bad_engine_config(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kwargs).validate()


def test_async_generate_raises_before_first_yield(tiny_model_dir) -> None:
    async def main() -> None:
        engine = AsyncLLM(str(tiny_model_dir), max_model_len=64, num_kv_blocks=16)
        try:
            with pytest.raises(ValueError, match="prompt: must not be empty"):
                async for _ in engine.generate({"prompt_token_ids": []}, SamplingParams(), "x"):
                    raise AssertionError("yielded for a bad request")
            with pytest.raises(ValueError, match="temperature"):
                async for _ in engine.generate("hi", SamplingParams(temperature=-1), "y"):
                    pass
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "z")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            await engine.shutdown()

    asyncio.run(main())
