"""The offline `LLM` API as vLLM users call it: prompt forms, order, chat, best_of, priority."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvfleet.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)


def test_prompt_forms_and_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("the cat sat on the mat")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    by_text = llm.generate("the cat sat on the mat", greedy)[0]
    assert by_text.prompt == "the cat sat on the mat" and by_text.prompt_token_ids == ids
    by_ids = llm.generate(ids, greedy)[0]                           # one prompt as a list of ids
    by_dict = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)
    # Different lengths finish in a different order than given; outputs keep the input order.
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in (9, 1, 5)]
    outs = llm.generate([[5, 6], [7, 8, 9], [10]], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5]
    assert [o.prompt_token_ids for o in outs] == [[5, 6], [7, 8, 9], [10]]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_chat_applies_the_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "hello there"}]
    out = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]],
                   SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids[:2]
    with pytest.raises(ValueError, match="messages: each message must be a dict with 'role' and 'content'"):
        llm.chat([{"content": "no role"}])


def test_stop_reason_is_none_on_eos_and_the_matched_stop_token_id(llm: LLM, tiny_model_dir, tmp_path) -> None:
    """As vLLM: stop_reason is None when EOS ends a sequence, the id when a stop_token_ids entry does."""
    prompt = [7, 8, 9, 10]
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    tok = base.token_ids[4]
    cut = base.token_ids.index(tok) + 1
    # The same weights with `tok` as the model's EOS (config and generation config).
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "eos-model"))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = tok
        (folder / name).write_text(json.dumps(cfg))
    eos_llm = LLM(str(folder), num_kv_blocks=64, max_model_len=256)
    assert tok in eos_llm.llm_engine.eos_token_ids
    greedy = dict(temperature=0.0, max_tokens=12)
    cases = [(SamplingParams(**greedy), None),                                     # ended by EOS
             (SamplingParams(**greedy, stop_token_ids=[tok]), None),               # EOS wins, as in vLLM
             (SamplingParams(**greedy, stop_token_ids=[tok], ignore_eos=True), tok)]   # only the stop id
    for params, reason in cases:
        out = eos_llm.generate(prompt, params)[0].outputs[0]
        assert out.token_ids == base.token_ids[:cut] and out.finish_reason == "stop"
        assert out.stop_reason == reason, params
    out = eos_llm.generate(prompt, SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == base.token_ids and out.finish_reason == "length" and out.stop_reason is None


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    out = llm.generate([[3, 4, 5, 6]], SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8,
                                                      ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1] and all(c.logprobs is None for c in out.outputs)
    cums = [c.cumulative_logprob for c in out.outputs]
    assert cums[0] >= cums[1] and cums[0] < 0
    every = llm.generate([[3, 4, 5, 6]], SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True,
                                                        logprobs=0))[0]
    ranked = sorted((c.cumulative_logprob for c in every.outputs), reverse=True)
    assert cums == pytest.approx(ranked[:2], abs=1e-4)      # the same 5 seeded samples, best two kept


def test_priority_runs_urgent_requests_first(tiny_model_dir) -> None:
    one_at_a_time = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=1)
    outs = one_at_a_time.generate([[1, 2], [3, 4], [5, 6]], SamplingParams(max_tokens=3, ignore_eos=True),
                                  priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]


def test_a_failing_step_aborts_only_its_requests(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=1)
    eng = llm.llm_engine
    real = eng.runner.execute

    def broken(sched):
        raise RuntimeError("injected")

    eng.add_request("in-step", [1, 2, 3], SamplingParams(max_tokens=4))
    eng.add_request("queued", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))   # max_num_seqs=1
    eng.runner.execute = broken
    with pytest.raises(RuntimeError, match="step failed for 1 request"):
        eng.step()
    eng.runner.execute = real
    assert list(eng.groups) == ["queued"] and eng.stats()["kv_blocks_used"] == 0
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    assert outs[-1].request_id == "queued" and len(outs[-1].outputs[0].token_ids) == 4


def test_tensor_parallel_engine_matches_single_process(tiny_model_dir) -> None:
    """The runner's tensor-parallel seam: per-rank KV heads, CoW copies mirrored to the workers.
    Both on CPU: seeded sampling draws from the device's generator, which differs on CUDA."""
    prompts = [[1, 2, 3, 4, 5], list(range(10, 50))]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)]
    ref = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, device="cpu").generate(prompts, params)
    tp = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, tensor_parallel_size=2, device="cpu")
    try:
        got = tp.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in ref]
        assert tp.stats()["kv_blocks_used"] == 0
    finally:
        tp.shutdown()


def test_cache_salt_keeps_tenants_apart(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    eng = llm.llm_engine
    prompt = list(range(1, 40))               # two full blocks before the last token
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def run(rid: str, salt: str | None) -> int:
        before = eng.stats()["prefix_cache_hits"]
        eng.add_request(rid, prompt, params, cache_salt=salt)
        while eng.has_unfinished_requests():
            eng.step()
        return eng.stats()["prefix_cache_hits"] - before

    assert run("a1", "tenant-a") == 0
    assert run("b1", "tenant-b") == 0          # same tokens, other tenant: nothing shared
    assert run("a2", "tenant-a") == 32         # same tenant: both full blocks reused
    assert run("n1", None) == 0
