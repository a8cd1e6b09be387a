"""kvfleet's inference engine: `LLM` (offline), `AsyncLLM` (for the server), `SamplingParams`.

The heavy classes are imported lazily so that `kvfleet.engine.core` (torch-free)
can be imported without pulling in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvfleet.engine.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from kvfleet.engine.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from kvfleet.engine.async_llm import AsyncLLM
    from kvfleet.engine.llm import LLM

__all__ = ["AsyncLLM", "AsyncLLMEngine", "BeamSearchOutput", "BeamSearchParams", "CompletionOutput", "LLM",
           "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvfleet.engine.llm import LLM

        return LLM
    if name in ("AsyncLLM", "AsyncLLMEngine"):
        from kvfleet.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'kvfleet.engine' has no attribute {name!r}")
