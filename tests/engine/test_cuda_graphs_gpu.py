"""Decode CUDA graphs on a GPU (the `gpu` tests: `pytest -m gpu`; tests/engine_kernels runs Triton's interpreter,
which graphs cannot capture)."""

from typing import Any

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_short_and_long_context_graphs_replay_the_eager_tokens(tiny_model_factory: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the long split on, 160 sequences decode from the short-context graph while their contexts fit, then
    from the two-split one: greedy tokens identical to an eager engine's (float32)."""
    from kvfleet.engine import LLM, SamplingParams
    from kvfleet.engine.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "DEFAULT_LONG_SPLIT", 64)
    folder = str(tiny_model_factory("llama"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 40, (160,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    kw: dict[str, Any] = dict(dtype="float32", device="cuda", max_num_seqs=256, max_num_batched_tokens=8192,
                              max_model_len=256, gpu_memory_utilization=0.3)
    tokens = {}
    for eager in (True, False):
        llm = LLM(folder, enforce_eager=eager, **kw)
        tokens[eager] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        graphs = llm.llm_engine.runner.executor.graphs
        if not eager:
            assert graphs is not None and 160 in graphs.short_sizes and graphs.short_len == 64
            assert graphs.short_replays > 0   # the first decode steps: every context under 64 keys
        llm.shutdown()
    assert tokens[False] == tokens[True]
