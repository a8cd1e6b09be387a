"""Nothing a request sends may crash a step or disturb other requests: seeded random combinations of
edge sampling values (every one that validate() accepts), each run in one batch beside a greedy
witness request, which must give exactly what it gives alone; afterwards no block is held."""

from __future__ import annotations

import math
import random

from kvfleet.engine import LLM, SamplingParams

EDGES: dict[str, list[object]] = {
    "temperature": [0, 1e-6, 1e-300, 0.5, 5, 100, math.inf], "top_p": [1e-300, 0.3, 1.0],
    "top_k": [-1, 1, 2, 512], "min_p": [0.0, 0.5, 1.0], "presence_penalty": [-2, 0, 2],
    "frequency_penalty": [-2, 0, 2], "repetition_penalty": [1e-9, 0.5, 1, 2],
    "logprobs": [None, 0, 5, 512], "prompt_logprobs": [None, 0, 512], "min_tokens": [0, 3],
    "stop_token_ids": [[], [0, 1, 2]], "stop": [[], ["a"], ["e", " "]],
    "seed": [None, 0, -1, 2**63 - 1, -(2**63)], "ignore_eos": [False, True], "max_tokens": [1, 4, 9],
    "skip_special_tokens": [True, False], "include_stop_str_in_output": [False, True],
}
CASES = 40


def random_params(rng: random.Random) -> SamplingParams:
    kw = {k: rng.choice(v) for k, v in EDGES.items()}
    kw["min_tokens"] = min(kw["min_tokens"], kw["max_tokens"])  # type: ignore[type-var]
    mode = rng.choice(["n", "best_of", "beam", "plain"])
    if mode == "n":
        kw["n"] = 3
    elif mode == "best_of":
        kw.update(n=2, best_of=4)
    elif mode == "beam":
        kw.update(n=2, best_of=2, use_beam_search=True, temperature=0)
    return SamplingParams(**kw).validate(512)  # type: ignore[arg-type]


def test_edge_requests_never_fail_a_step_or_touch_their_neighbour(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=32)
    vocab = llm.llm_engine.model_config.vocab_size
    witness = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], witness)[0].outputs[0].token_ids
    rng = random.Random(1234)
    for _ in range(CASES):
        params = random_params(rng)
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 15, 16, 17, 40]))]
        out, beside = llm.generate([prompt, [5, 6, 7]], [params, witness])
        assert beside.outputs[0].token_ids == alone, params
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= params.max_tokens and all(0 <= t < vocab for t in c.token_ids), params
            for position in c.logprobs or []:
                assert all(not math.isnan(lp.logprob) for lp in position.values()), params
        stats = llm.stats()
        assert (stats["kv_blocks_used"], stats["num_running"], stats["num_waiting"]) == (0, 0, 0), params
