"""Block accounting (no leaks, n>1 shares the prompt), beam search vs transformers, seeded sampling."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=96, max_num_batched_tokens=64)


def assert_no_leak(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    kv = llm.llm_engine.kv
    kv.check_invariants()
    assert kv.pool.num_free_blocks == s["kv_blocks_total"]   # every block free or cached
    assert not llm.llm_engine.groups


def test_nothing_leaks_after_finish_and_abort(llm: LLM) -> None:
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 20, 37, 64)]
    eng.add_request("a", prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("b", prompts[1], SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=3))
    eng.add_request("c", prompts[2], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request("d", prompts[3], SamplingParams(use_beam_search=True, best_of=2, max_tokens=6))
    for _ in range(4):
        eng.step()
    assert llm.stats()["kv_blocks_used"] > 0
    eng.abort_request(["c"])                      # mid-flight
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leak(llm)
    llm.generate(prompts, SamplingParams(max_tokens=5, stop=["e"]))
    assert_no_leak(llm)


def test_n4_holds_the_prompt_blocks_once(llm: LLM) -> None:
    eng = llm.llm_engine
    prompt = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    eng.add_request("n4", prompt, SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    while not eng.groups["n4"].seqs or len(eng.groups["n4"].seqs) < 4 or \
            any(not st.seq.output_token_ids for st in eng.groups["n4"].seqs.values()):
        eng.step()
    # 200 tokens = 12 full blocks of 16 shared by all four + the partly filled 13th: one each (CoW).
    assert llm.stats()["kv_blocks_used"] == 12 + 4          # not 4 * 13 = 52
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    final = [o for o in outs if o.finished][0]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1    # distinct samples
    assert_no_leak(llm)


def test_n2_on_a_fully_cached_prefix(llm: LLM) -> None:
    # 33 tokens: the fork point (32 tokens) is exactly two cached blocks the second time.
    prompt = torch.randint(3, 500, (33,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    hits = llm.stats()["prefix_cache_hits"]
    again = llm.generate([prompt], params)[0]
    assert llm.stats()["prefix_cache_hits"] - hits == 16     # one block reused, the last one recomputed
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert_no_leak(llm)


# Extra stop tokens (frequent in this model's beams) make hypotheses finish early, so the
# finished-hypotheses and early-stop rules are exercised, not only the max-length path.
@pytest.mark.parametrize("width,extra_eos", [(2, []), (4, []), (3, [243, 42, 509, 457])])
def test_beam_search_matches_transformers(llm: LLM, tiny_model_dir, width: int, extra_eos: list[int]) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    eos = set(llm.llm_engine.eos_token_ids) | set(extra_eos)
    g = torch.Generator().manual_seed(width)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 18, 30)]
    params = SamplingParams(use_beam_search=True, best_of=width, max_tokens=12, temperature=0.0,
                            stop_token_ids=extra_eos)
    ours = llm.generate(prompts, params)
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=12,
                              length_penalty=1.0, early_stopping=False, pad_token_id=0,
                              eos_token_id=sorted(eos))[0, len(prompt):].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert out.outputs[0].token_ids == ref[:cut]
    assert_no_leak(llm)


def test_seeded_sampling_same_alone_and_in_a_busy_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = [11, 22, 33, 44, 55, 66, 77]
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    g = torch.Generator().manual_seed(9)
    others = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 30, 12, 50)]
    busy_params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 + [seeded] + \
                  [SamplingParams(temperature=0.5, min_p=0.1, max_tokens=9, ignore_eos=True)] * 2
    busy = llm.generate(others[:2] + [prompt] + others[2:], busy_params)
    assert busy[2].outputs[0].token_ids == alone
    unseeded = llm.generate([prompt] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_beam_search_params_api(llm: LLM) -> None:
    from kvfleet.engine import BeamSearchParams

    prompt = [9, 8, 7, 6, 5]
    res = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))[0]
    old = llm.generate([prompt], SamplingParams(n=3, use_beam_search=True, max_tokens=6))[0]
    assert [s.tokens for s in res.sequences] == [prompt + c.token_ids for c in old.outputs]
    scores = [s.cum_logprob for s in res.sequences]
    assert len(scores) == 3 and all(isinstance(x, float) for x in scores)
    assert_no_leak(llm)
