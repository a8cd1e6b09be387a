"""The vLLM side of the throughput benchmark: the same workloads through ``vllm.LLM.generate``.

Only on the GPU machine, where vLLM 0.26.0 is installed from carried wheels (``bench/vllm_wheels.sh``);
nothing here imports vLLM until a run starts, so the CPU tests can check the arguments it builds.
Same conditions as the kvfleet side: token-id prompts, ``ignore_eos``, greedy unless ``n > 1`` (then
random sampling at ``SAMPLE_TEMPERATURE``), the same engine limits, dummy weights, no tokenizer
(``skip_tokenizer_init`` when the model folder has none, and ``detokenize=False``: kvfleet without a
tokenizer does not detokenize either).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from kvfleet.engine.bench.step_trace import RequestClock, StepTrace
from kvfleet.engine.bench.workloads import BenchRequest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model: str) -> bool:
    return any(Path(model, f).is_file() for f in TOKENIZER_FILES)


def llm_kwargs(args: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` for these benchmark arguments (names from vLLM 0.26.0's ``LLM.__init__`` and
    ``EngineArgs``)."""
    kw: dict[str, Any] = {
        "model": str(args.model), "dtype": args.dtype, "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": not args.no_prefix_caching,
        "enforce_eager": args.enforce_eager, "tensor_parallel_size": args.tensor_parallel_size, "seed": 0,
        "skip_tokenizer_init": not has_tokenizer(str(args.model)),
    }
    if args.load_format != "auto":
        kw["load_format"] = args.load_format
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    if args.block_size is not None:
        kw["block_size"] = args.block_size
    if args.num_kv_blocks is not None:
        kw["num_gpu_blocks_override"] = args.num_kv_blocks
    return kw


def sampling_kwargs(r: BenchRequest) -> dict[str, Any]:
    """``vllm.SamplingParams(**kwargs)`` of one request."""
    return {"n": r.n, "temperature": r.temperature, "max_tokens": r.max_tokens, "ignore_eos": True,
            "detokenize": False, "repetition_penalty": r.repetition_penalty}


class VllmBench:
    """One ``vllm.LLM`` for several workloads (its start, compile and graph capture paid once)."""

    def __init__(self, args: argparse.Namespace, max_model_len: int, warm: list[BenchRequest]) -> None:
        from vllm import LLM

        self.args = args
        self.max_model_len = max_model_len
        self.kwargs = llm_kwargs(args, max_model_len)
        t = time.monotonic()
        self.llm = LLM(**self.kwargs)
        self.init_s = time.monotonic() - t
        if warm:
            self._generate(warm)
        self.llm.reset_prefix_cache()

    def _generate(self, reqs: list[BenchRequest]) -> list[Any]:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [SamplingParams(**sampling_kwargs(r)) for r in reqs]
        return self.llm.generate(prompts, params, use_tqdm=False)

    def run(self, reqs: list[BenchRequest]) -> dict[str, Any]:
        import torch

        torch.cuda.synchronize()
        t0 = time.monotonic()
        trace = StepTrace() if self.args.step_trace else None
        core = self.llm.llm_engine.engine_core
        if trace is not None:
            core.get_output = traced_get_output(core.get_output, trace, t0)   # an instance attribute: undone below
        try:
            outs = self._generate(reqs)
            torch.cuda.synchronize()
            wall = time.monotonic() - t0
        finally:
            if trace is not None:
                del core.get_output
        short = 0
        for r, o in zip(reqs, outs, strict=True):
            lens = [len(c.token_ids) for c in o.outputs]
            short += int(len(lens) != r.n or any(n != r.max_tokens for n in lens))
        self.llm.reset_prefix_cache()
        # No TTFT/TPOT here: vLLM's offline request stats mix the engine core's clock with the
        # frontend's; the online stage measures latency for both servers with one client.
        res: dict[str, Any] = {"wall_s": wall, "init_s": self.init_s, "max_model_len": self.max_model_len,
                               "requests_with_wrong_length": short, "vllm_kwargs": self.kwargs,
                               "vllm_version": _vllm_version()}
        if trace is not None:
            res["step_trace"] = trace.to_json()
        return res

    def close(self) -> None:
        del self.llm
        import gc

        gc.collect()


def traced_get_output(get_output: Callable[[], Any], trace: StepTrace, t0: float) -> Callable[[], Any]:
    """vLLM's engine-core client `get_output` (one engine step's `EngineCoreOutputs` a call), recording into `trace`
    when each step's tokens arrived and how many, and each request's first and last token."""
    clock = RequestClock(trace)

    def get_output_traced() -> Any:
        step = get_output()
        t = time.monotonic() - t0
        tokens = 0
        for o in step.outputs:
            tokens += len(o.new_token_ids)
            if o.new_token_ids or o.finish_reason is not None:
                clock.observe(t, o.request_id, o.finish_reason is not None)
        trace.add_step(t, tokens)
        return step

    return get_output_traced


def _vllm_version() -> str | None:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return None
