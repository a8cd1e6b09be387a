"""Qwen3's per-head q/k norm on a GPU (a `gpu` test: `pytest -m gpu`): normalised inside the rotary + cache-write
kernel, under CUDA graphs and the GPU's prefill kernels, as the model's own two norms before the attention op."""

from typing import Any

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_qk_norm_gives_the_tokens_of_the_models_own_norms(tiny_model_factory: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.engine import LLM, SamplingParams
    from kvfleet.engine.models import llama

    folder = str(tiny_model_factory("qwen3"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(8, 120, (48,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)
    kw: dict[str, Any] = dict(dtype="float32", device="cuda", max_num_seqs=64, max_num_batched_tokens=2048,
                              max_model_len=256, gpu_memory_utilization=0.3)
    runs: dict[bool, list[Any]] = {}
    for fused in (True, False):
        monkeypatch.setattr(llama, "FUSED_QK_NORM", fused)
        llm = LLM(folder, **kw)
        runs[fused] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert [list(o.token_ids) for o in runs[True]] == [list(o.token_ids) for o in runs[False]]
    for a, b in zip(runs[True], runs[False], strict=True):   # the chosen tokens' logprobs, to float32 rounding
        assert a.logprobs is not None and b.logprobs is not None
        for step_a, step_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-4)
