"""Warm every step shape and sampler path before the server says it is ready.

On CUDA, Triton compiles a kernel the first time a launch brings a new specialization (its constexprs:
the prefill tile for query chunks of at most 16 tokens or more, whether decode rows share the step, the
split count; 0.3-1 s each, from source, less from Triton's disk cache), and torch loads each CUDA module
on its first use. Without a warm-up the first requests of a fresh server pay for that: issue 16 measured
a TTFT p99 of 757 ms against vLLM's 115 ms at 0.5 req/s. Start-up already compiles the prefill kernel
(the memory-profiling forward) and every decode graph (capture); this plan adds the rest, through the
real engine, so it covers what the model runner really launches:

1. a prompt of more than 16 tokens alone: a prefill-only step with the wide prefill tile;
2. while it decodes, a 9-token prompt with random sampling (top-k, top-p, min-p, a seed, logprobs): a mixed
   step (prefill rows beside decode rows) with the narrow tile, and the sampler's random path;
3. then a 33-token prompt with penalties, min_tokens and stop ids, prompt logprobs: a mixed step with the
   wide tile, and the sampler's penalty and masking paths;
4. alone, a 12-token prompt with n=2: a prefill-only step with the narrow tile, then the fork and the
   copy-on-write block copy of parallel sampling (n=1 in an engine of max_num_seqs 1, which refuses n=2);
5. a 72-token prompt with n=2, whose two samples share 64 tokens of KV blocks: their decodes take the
   shared-prefix pass (`attention.shared_prefix`); after one decode step
6. a 20-token prompt: a mixed step whose decode rows share a prefix;
7. on CUDA, where the context and the step's token budget allow, while a 16-token prompt decodes, a prompt of more than
   2,048 tokens and a 24-token one: a mixed step with the long-query tile (a step's tile follows its longest query;
   queries of 17..2,048 tokens take a tile of their own, `kernels.prefill_attention_v2.default_tile_v2`; a
   prefill-only step with it runs at start-up's profiling), and with the Gluon choices of `KVFLEET_PREFILL_KERNEL`
   (`gluon-chunks`, the default, or `gluon`) the Gluon kernel of fresh long prompts, beside the Triton kernel,
   which then has the short prompt's rows (lease 23: without them it did not launch, and chat-mix compiled that
   variant on a request's time);
8. then that prompt again with 192 tokens more: a chunk over its cached prefix (a prefix-cache hit), the shape
   `gluon-chunks` sends to the paged Gluon kernel (`attention.fresh_prompts.long_prefix_chunks`);
9. for each split count the decode rows of an eager mixed step can get (`kernels.paged_decode.
   choose_mixed_decode_splits`: from their count, their longest context and the GPU's SMs; a power of two up to
   16), that many prompts of ~1k tokens, then, once they decode, a short prompt beside them (`split_waves`); in the
   eager pass only (below: a captured mixed step keeps one split, so replayed they would warm nothing).

Where CUDA graphs were captured, the plan runs twice: replayed, then with every forward eager, since the steps
that fit no graph (more prompts or tokens than a captured step with prefill takes) launch the kernels'
eager variants (the narrow prefill tile above all), which the replays never compile.

On CUDA the warm-up then launches the structured-output mask kernel once, and computes logits once for every row
count a step can sample (1..max_num_seqs): cuBLAS
picks its matmul kernel by the row count, and with CUDA's lazy module loading (the default since 12.2) the
first launch of each kernel loads it, which waits for all the work queued on the device. Issue 16 measured
this in the offline chat-mix run: each step that brought a new row count stalled ~350 ms in `compute_logits`,
a whole step's GPU time with nothing queued behind it (~1 s of the first workload's 22 s).

Afterwards nothing is left behind: no request, no KV block in use, the prefix cache emptied (the warm-up's
blocks were cached on their salted hashes), and the counters the server exports reset.
`KVFLEET_WARMUP=0` skips it (the server then runs only a one-token request, `ONE_STEP_PLAN`); by default the server
runs it on CUDA only (`warmup_runs_plan`: on a CPU it bought nothing and cost seconds of every start).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvfleet.engine.attention.fresh_prompts import GLUON_CHUNK_MIN_QUERY_TOKENS
from kvfleet.engine.env_settings import EnvSettingError
from kvfleet.engine.kernels.prefill_attention_v2 import SHORT_QUERY_MAX_TOKENS

if TYPE_CHECKING:
    import torch

    from kvfleet.engine.model_executor import ModelExecutor

logger = logging.getLogger(__name__)

WARMUP_SALT = "kvfleet-warmup"   # its prompts hash apart from every user's (and are evicted after)
BESIDE_LONG_PROMPT_TOKENS = 24   # 7.'s short prompt: more than one token (the prefill kernel skips one-token rows)
SPLIT_WAVE_PROMPT_TOKENS = 24    # 9.'s prompt that joins the decoding rows


@dataclass(frozen=True)
class WarmupRequest:
    prompt_len: int
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)   # SamplingParams fields besides max_tokens
    reuse_prefix: int = 0   # its first tokens are the previous request's prompt (a prefix-cache hit: a chunk over them)


@dataclass(frozen=True)
class Wave:
    """Requests added together, then `steps` engine steps before the next wave is added (so the earlier
    requests are decoding when the next wave's prompts arrive: mixed steps); None: until all are done."""

    requests: tuple[WarmupRequest, ...]
    steps: int | None


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    steps: int
    seconds: float
    triton_compiles: int | None   # kernel variants readied during the warm-up (CUDA; None without the hook)
    prefix_cache_hits: int = 0    # prompt tokens its requests found cached (8. above, the n=2 forks aside)


def warmup_plan(max_model_len: int, vocab_size: int, max_num_seqs: int = 256,
                max_num_batched_tokens: int = 0) -> list[Wave]:
    """The waves above, shortened where max_model_len is small (tests), n within max_num_seqs; the long prompt
    (7.) only where max_model_len and max_num_batched_tokens let a query of more than
    SHORT_QUERY_MAX_TOKENS tokens into one step."""
    room = max(2, max_model_len - 8)   # prompt + max_tokens must fit

    def plen(n: int) -> int:
        return max(1, min(n, room - 6))

    stop = min(1, vocab_size - 1)
    long_len = SHORT_QUERY_MAX_TOKENS + 64
    chunk_len = GLUON_CHUNK_MIN_QUERY_TOKENS + 64
    # a short prompt beside the long one where the step's budget takes both: the long one goes to the Gluon kernel,
    # so without it the step's Triton prefill kernel has no rows and never launches its long-query tile beside
    # decode rows (lease 23: compiled on the first request's time in chat-mix). Added first: the chunk below
    # reuses the prompt added last.
    beside_long = (WarmupRequest(BESIDE_LONG_PROMPT_TOKENS, 2, {"temperature": 0.0}),) \
        if max_num_batched_tokens >= long_len + BESIDE_LONG_PROMPT_TOKENS else ()
    long_wave = [Wave((WarmupRequest(plen(16), 8, {"temperature": 0.0}),), 1),
                 Wave(beside_long + (WarmupRequest(long_len, 2, {"temperature": 0.0}),), None)]
    if long_len + chunk_len + 2 <= room:
        long_wave.append(Wave((WarmupRequest(long_len + chunk_len, 2, {"temperature": 0.0}, reuse_prefix=long_len),),
                              None))
    fits_long = long_len + 2 <= room and max_num_batched_tokens > SHORT_QUERY_MAX_TOKENS + 1   # a chunk past it
    return [
        Wave((WarmupRequest(plen(40), 6, {"temperature": 0.0}),), 1),
        Wave((WarmupRequest(plen(9), 4, {"temperature": 0.8, "top_k": min(20, vocab_size), "top_p": 0.9,
                                         "min_p": 0.05, "seed": 1, "logprobs": 2}),), 1),
        Wave((WarmupRequest(plen(33), 4, {"temperature": 0.0, "repetition_penalty": 1.1,
                                          "frequency_penalty": 0.2, "presence_penalty": 0.2, "min_tokens": 2,
                                          "stop_token_ids": [stop], "prompt_logprobs": 1}),), None),
        Wave((WarmupRequest(plen(12), 3, {"temperature": 0.7, "n": min(2, max_num_seqs)}),), None),
        Wave((WarmupRequest(plen(72), 4, {"temperature": 0.7, "n": min(2, max_num_seqs)}),), 2),
        Wave((WarmupRequest(plen(20), 2, {"temperature": 0.0}),), None),
    ] + (long_wave if fits_long else [])


def split_context(max_model_len: int, max_splits: int, split_unit: int) -> int:
    """9.'s prompt length: contexts that allow ``max_splits`` splits of ``split_unit`` keys (fewer where
    max_model_len is short), half a unit short of a multiple of it, so the few tokens they decode before the mixed
    step do not change the split count; 0 where they would not split at all."""
    units = min(max_splits, (max_model_len * 3 // 4) // split_unit)
    return units * split_unit - split_unit // 2 if units >= 2 else 0


def split_waves(decodes_by_splits: dict[int, int], context: int, max_model_len: int, step_tokens: int) -> list[Wave]:
    """9.: for each split count, its number of prompts of `context` tokens, stepped until they all decode (their
    prefill's steps, then two), then a short prompt: a mixed step beside that many decode rows. A count whose
    prompts and tokens would not fit max_model_len is left out."""
    waves = []
    for splits in sorted(decodes_by_splits):
        n = decodes_by_splits[splits]
        steps = -(-n * context // max(1, step_tokens)) + 2
        if context + steps + 4 > max_model_len:
            continue
        decoding = tuple(WarmupRequest(context, steps + 4, {"temperature": 0.0}) for _ in range(n))
        waves += [Wave(decoding, steps), Wave((WarmupRequest(SPLIT_WAVE_PROMPT_TOKENS, 2, {"temperature": 0.0}),),
                                              None)]
    return waves


# what the server runs instead of the plan (a CPU by default, or KVFLEET_WARMUP=0): one real one-token step, so
# /health is 200 only once the model has run, with the same clean-up after it
ONE_STEP_PLAN = [Wave((WarmupRequest(1, 1, {"temperature": 0.0}),), None)]


def warmup_runs_plan(device_type: str, raw: str | None = None) -> bool:
    """Whether the server runs the warm-up's plan before /health (`KVFLEET_WARMUP`, read when ``raw`` is None): 1 or
    0 as set; unset or "auto", on CUDA only. On a CPU nothing is compiled or loaded on first use (torch's CPU kernels,
    no Triton, no graphs): the plan took as long a second time, and a replica of the embedded model was healthy ~4 s
    later with it for the same first request's time to first token (`bench/cpu_gguf_startup.py`); there the server
    runs `ONE_STEP_PLAN` instead."""
    value = (os.environ.get("KVFLEET_WARMUP", "auto") if raw is None else raw).strip().lower() or "auto"
    if value == "auto":
        return device_type == "cuda"
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise EnvSettingError(f"KVFLEET_WARMUP: expected 0, 1 or auto, got {value!r}")
    return value in ("1", "true", "yes", "on")


def run_warmup(engine: Any, plan: list[Wave] | None = None) -> WarmupReport:
    """Drive `engine` (an idle LLMEngine: no request of its own) through the plan, then clean up. The whole plan
    (``plan`` None) runs again eagerly where graphs were captured and ends on CUDA with the logits of every row
    count and the structured-output mask kernel; a plan given is run once, alone."""
    import numpy as np

    from kvfleet.engine.sampling_params import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("warm-up: the engine already has requests")
    TRITON_COMPILES.install()
    mc = engine.model_config
    runner = engine.runner
    # the long prompt (7.) warms a Triton tile: only on CUDA (on a CPU it would only cost seconds of prefill)
    budget = runner.max_num_batched_tokens if engine.device.type == "cuda" else 0
    whole = plan is None
    if plan is None:
        plan = warmup_plan(mc.max_model_len, mc.vocab_size, engine.config.max_num_seqs, budget)
    eager_only = mixed_split_plan(engine) if whole else []
    rng = np.random.default_rng(20261201)
    high = max(2, min(mc.vocab_size, 32000))
    compiles = TRITON_COMPILES.count
    t0 = time.monotonic()
    steps, n = 0, 0
    previous: list[int] = []
    # eager: the steps no graph fits
    passes = [False, True] if runner.executor.graphs is not None and whole else [False]
    try:
        for i, eager in enumerate(passes):
            runner.eager_forward = eager
            for wave in plan + (eager_only if i == len(passes) - 1 else []):
                for req in wave.requests:
                    ids = warmup_prompt(rng, high, req, previous)
                    previous = ids
                    params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, **req.sampling)
                    engine.add_request(f"kvfleet-warmup-{n}", {"prompt_token_ids": ids}, params,
                                       cache_salt=WARMUP_SALT)
                    n += 1
                for _ in range(wave.steps if wave.steps is not None else 1000):
                    if wave.steps is None and not engine.has_unfinished_requests():
                        break
                    engine.step()
                    steps += 1
            if engine.has_unfinished_requests():
                raise RuntimeError("warm-up: requests did not finish in 1000 steps")
    finally:
        runner.eager_forward = False
    if engine.device.type == "cuda" and whole:
        secs = warm_logits(runner.executor, engine.config.max_num_seqs, mc.hidden_size, mc.dtype, engine.device)
        logger.info("warm-up: logits for 1..%d rows in %.2f s", engine.config.max_num_seqs, secs)
        warm_token_bitmask(mc.vocab_size, engine.device)
    hits = engine.kv.prefix_cache_hits
    _clean_up(engine)
    done = TRITON_COMPILES.count
    report = WarmupReport(n, steps, time.monotonic() - t0, None if not TRITON_COMPILES.installed else done - compiles,
                          hits)
    logger.info("warm-up: %d requests, %d steps in %.2f s (%s Triton kernel variants compiled)", report.requests,
                report.steps, report.seconds, report.triton_compiles if report.triton_compiles is not None else "?")
    return report


def mixed_split_plan(engine: Any) -> list[Wave]:
    """9. for this engine: its KV heads, its device's SMs, its context and step budget."""
    from kvfleet.engine.attention.triton_backend import mixed_split_warmup_batches
    from kvfleet.engine.kernels.paged_decode import DEFAULT_BLOCK_N, DEFAULT_SPLIT_TOKENS, MIXED_MAX_SPLITS

    max_model_len = engine.model_config.max_model_len
    context = split_context(max_model_len, MIXED_MAX_SPLITS, max(DEFAULT_SPLIT_TOKENS, DEFAULT_BLOCK_N))
    if not context:
        return []
    runner = engine.runner
    batches = mixed_split_warmup_batches(engine.device, runner.num_kv_heads, context + 2,
                                         engine.config.max_num_seqs - 1)
    return split_waves(batches, context, max_model_len, runner.max_num_batched_tokens)


def warmup_prompt(rng: Any, high: int, req: WarmupRequest, previous: list[int]) -> list[int]:
    """`req`'s prompt: random token ids below `high`, its first `reuse_prefix` the previous prompt's."""
    reused = previous[:req.reuse_prefix]
    if len(reused) < req.reuse_prefix:
        raise ValueError(f"warm-up: reuse_prefix {req.reuse_prefix} but the previous prompt has {len(previous)} tokens")
    return reused + rng.integers(0, high, size=req.prompt_len - len(reused)).tolist()


def warm_logits(executor: ModelExecutor, max_rows: int, hidden_size: int, dtype: torch.dtype,
                device: torch.device) -> float:
    """Logits for every row count 1..max_rows, so each matmul kernel cuBLAS picks is loaded before serving
    (see the module's docstring); -> seconds taken (~1 s for Llama-3.1-8B at 1,024 rows on an H200)."""
    import torch

    t = time.monotonic()
    hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            executor.compute_logits(hidden[:rows])
    if hidden.device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic() - t


def warm_token_bitmask(vocab_size: int, device: torch.device) -> None:
    """The structured-output mask kernel once, at the shapes the sampler gives it (float32 logits of the whole
    vocabulary, one int32 word per 32 tokens): the first constrained request then compiles nothing. No
    constraint is compiled (that needs the tokenizer's token table, built on the first such request)."""
    import torch

    from kvfleet.engine.kernels.token_bitmask import apply_token_bitmask_

    logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    words = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
    apply_token_bitmask_(logits, words, torch.zeros(1, dtype=torch.int64, device=device))


def _clean_up(engine: Any) -> None:
    """No block in use, nothing cached, counters as a fresh engine's."""
    sched, kv = engine.scheduler, engine.kv
    if sched.has_unfinished() or engine.groups:
        raise RuntimeError("warm-up: requests left behind")
    kv.reset_prefix_cache()
    used = engine.stats()["kv_blocks_used"]
    if used:
        raise RuntimeError(f"warm-up: {used} KV blocks still in use")
    engine.prompt_tokens = engine.generation_tokens = 0
    engine.num_overlapped_steps = engine.num_launched_ahead = engine.num_forwarded_ahead = 0
    engine.idle_steps = 0
    sched.num_preemptions = 0
    kv.prefix_cache_hits = kv.prefix_cache_queries = 0
    engine.runner.num_placeholder_inputs = 0


class _CompileCounter:
    """Counts the Triton kernel variants readied in this process: compiled, or loaded from Triton's disk cache, each
    on its first launch (Triton's kernel-load hook; CUDA only: the interpreter loads nothing). After `serving()`
    each one is logged as a warning: a variant the warm-up missed, paid by a request's latency (a compile, or at
    least a module load, which waits for the work queued on the GPU).

    Not Triton's post-compile hook: Triton serializes a kernel's constexpr arguments to JSON before it calls that
    one, and the Gluon prefill kernels take layout objects there (issue 16, lease 14: with it set, a chunk's first
    paged Gluon kernel failed its step). The load hook is a chain others may join, and takes no arguments' values."""

    def __init__(self) -> None:
        self.count = 0
        self.installed = False
        self.after_ready = 0
        self._serving = False

    def install(self) -> bool:
        """Join Triton's kernel-load hook chain (once); False without Triton."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        knobs.runtime.kernel_load_end_hook.add(self._loaded)   # (Triton 3.6, torch 2.11's)
        self.installed = True
        return True

    def serving(self) -> None:
        self._serving = True

    def _loaded(self, module: Any, function: Any, name: str, metadata_group: dict[str, str], hash: str) -> None:
        self.count += 1
        if self._serving:
            self.after_ready += 1
            logger.warning("Triton readied a kernel variant while serving (not covered by the warm-up): %s %s",
                           name, hash[:16])


TRITON_COMPILES = _CompileCounter()
