"""vLLM's `allowed_token_ids` and `bad_words` on a real engine: greedy tokens equal transformers' argmax with the
same tokens masked by hand (synchronous and async scheduling, batched with a free request that stays as it was);
they hold beside a structured output and in each of `n` samples; bad values are a ValueError naming the field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.core.grammar import AllOf, BannedSequences, TokenSet
from kvfleet.engine.sampling_params import StructuredOutputsParams
from kvfleet.engine.token_rules import pack_tokens


def hf_greedy(hf: Any, prompt: list[int], max_new: int, banned: Callable[[list[int]], set[int]]) -> list[int]:
    """transformers' greedy continuation with `banned(output so far)` at -inf at each step (ignore_eos)."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            logits[sorted(banned(out))] = float("-inf")
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_allowed_token_ids_and_bad_words_are_transformers_argmax_with_them_masked(tiny: LLM, hf_tiny: Any) -> None:
    tok = tiny.get_tokenizer()
    vocab = hf_tiny.config.vocab_size
    prompt = tok.encode("the quick brown fox jumps over")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = tiny.generate([{"prompt_token_ids": prompt}], free)[0].outputs[0].token_ids
    # a set without the free output's first tokens, so that the rule changes the answer
    allowed = [t for t in range(3, vocab, 7) if t not in plain[:3]]
    word = tok.decode(plain[2:4]).strip()   # a word the free output writes
    spellings = [tuple(tok.encode(w, add_special_tokens=False)) for w in (word, " " + word)]

    def banned_words(out: list[int]) -> set[int]:
        return {s[-1] for s in spellings if len(s) == 1 or tuple(out[len(out) - len(s) + 1:]) == s[:-1]}

    outs = tiny.generate([{"prompt_token_ids": prompt}] * 3, [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, bad_words=[word]),
        free])
    assert outs[0].outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 12, lambda out: set(range(vocab)) - set(allowed))
    assert outs[1].outputs[0].token_ids == hf_greedy(hf_tiny, prompt, 12, banned_words)
    assert outs[1].outputs[0].token_ids != plain and outs[2].outputs[0].token_ids == plain
    assert word not in outs[1].outputs[0].text


def test_the_rules_hold_beside_a_structured_output_and_in_every_sample(tiny: LLM) -> None:
    digits = [tiny.get_tokenizer().convert_tokens_to_ids(d) for d in "0123456789"]
    eos = sorted(tiny.llm_engine.eos_token_ids)
    allowed = [t for t in digits if t is not None and t not in (digits[7], digits[8], digits[9])] + eos
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3, allowed_token_ids=allowed,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    (out,) = tiny.generate(["count:"], params)
    for sample in out.outputs:
        assert re.fullmatch("[0-6]{4}", sample.text) and sample.finish_reason == "stop", sample


@pytest.mark.parametrize("kwargs,field", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["x"], "use_beam_search": True, "n": 2}, "bad_words"),
])
def test_bad_values_name_the_field(tiny: LLM, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        tiny.generate(["x"], SamplingParams(max_tokens=2, **kwargs))


def mask_of(grammar: Any, words: int = 2) -> list[int]:
    mask = np.zeros((1, words), dtype=np.int32)
    grammar.fill_bitmask(mask, 0)
    return [int(t) for t in np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))]


def test_banned_sequences_follow_the_output_and_all_of_intersects() -> None:
    """Sequence (5, 6, 31) bans 31 right after 5 6 only, and (40,) always; forks go on by themselves; AllOf allows
    what each part allows."""
    banned = BannedSequences([(5, 6, 31), (40,)], 2)
    assert 31 in mask_of(banned) and 40 not in mask_of(banned)
    assert banned.accept(5) and banned.accept(6)
    twin = banned.fork()
    assert 31 not in mask_of(banned) and not banned.accept(31)
    assert twin.accept(7) and 31 in mask_of(twin)
    both = AllOf([TokenSet(pack_tokens([1, 31, 40, 63], 2)), BannedSequences([(40,)], 2)])
    assert mask_of(both) == [1, 31, 63] and both.accept(63) and not both.accept(40)
    # A mask that is the same at every step lets the next step launch before this one's token is taken.
    assert not TokenSet(pack_tokens([1], 2)).needs_last_token()
    assert not BannedSequences([(40,), (41,)], 2).needs_last_token()
    assert BannedSequences([(40,), (5, 6)], 2).needs_last_token()
    assert not AllOf([TokenSet(pack_tokens([1], 2)), BannedSequences([(40,)], 2)]).needs_last_token()
    assert AllOf([TokenSet(pack_tokens([1], 2)), BannedSequences([(5, 6)], 2)]).needs_last_token()


def test_allowed_token_ids_launch_ahead_and_a_structured_output_waits(tiny_model_dir: Path, hf_tiny: Any) -> None:
    """With async scheduling, rows whose only rule is allowed_token_ids are launched ahead (their mask does not
    follow the output) and still equal transformers' argmax with the rest masked; a regex row's steps wait for the
    token in flight, as its mask follows it."""
    fast = LLM(str(tiny_model_dir), num_kv_blocks=96, max_num_batched_tokens=64, async_scheduling=True)
    engine, vocab = fast.llm_engine, hf_tiny.config.vocab_size
    prompts = [[5, 17, 29, 41], [7, 19, 3, 88, 120]]
    sets = [list(range(3, vocab, 5)), list(range(4, vocab, 3))]
    outs = fast.generate([{"prompt_token_ids": p} for p in prompts], [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, allowed_token_ids=s) for s in sets])
    for prompt, allowed, out in zip(prompts, sets, outs, strict=True):
        want = hf_greedy(hf_tiny, prompt, 10, lambda _, allowed=allowed: set(range(vocab)) - set(allowed))
        assert out.outputs[0].token_ids == want
    assert engine.num_launched_ahead >= 8
    engine.num_launched_ahead = 0
    regex = SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-f]{6}"))
    assert re.fullmatch("[a-f]{6}", fast.generate([{"prompt_token_ids": prompts[0]}], regex)[0].outputs[0].text)
    assert engine.num_launched_ahead == 0
