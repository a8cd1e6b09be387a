"""The warm-up before /health (issue 16's TTFT p99): it covers every Triton kernel variant a varied workload
launches, leaves nothing behind, and the server answers 503 until it has run.

Kernel variants are what Triton compiles one by one on CUDA: each launch's key is computed here exactly as
Triton's JIT computes it (its own `native_specialize_impl` on every argument, constexprs by value, the launch
options), while the kernels run in the CPU interpreter inside a real engine. Decode-only steps are left
out: on CUDA they replay CUDA graphs whose kernels were compiled while capturing at start-up.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import numpy as np
import pytest

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.warmup import (
    SPLIT_WAVE_PROMPT_TOKENS,
    WARMUP_SALT,
    WarmupRequest,
    Wave,
    run_warmup,
    split_context,
    split_waves,
    warm_logits,
    warmup_plan,
    warmup_runs_plan,
)


class VariantRecorder:
    """Records (kernel, specialization key) of every Triton launch outside decode-only steps."""

    def __init__(self) -> None:
        self.keys: set[tuple[Any, ...]] = set()

    def key(self, jit_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        params = list(inspect.signature(jit_fn.fn).parameters.values())
        dns = set(jit_fn.kwargs.get("do_not_specialize") or ())
        bound = dict(zip([p.name for p in params], args, strict=False))   # the rest come as keywords
        bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
        spec = []
        for p in params:
            v = bound[p.name]
            if "constexpr" in str(p.annotation):
                spec.append((p.name, "constexpr", v))
            else:
                spec.append((p.name, *native_specialize_impl(BaseBackend, v, False, p.name not in dns, True)))
        opts = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages")))
        return (jit_fn.fn.__name__, tuple(spec), opts)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            recorder.keys.add(recorder.key(self, args, kwargs))
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(InterpretedFunction, "run", run)


@pytest.fixture
def triton_engine(monkeypatch: pytest.MonkeyPatch, tiny_model_factory: Any) -> Any:
    """make(**cfg) -> an engine whose attention runs the Triton kernels (interpreted on CPU) and a recorder."""
    from kvfleet.engine.kernels._common import interpret_mode

    if not interpret_mode():
        pytest.skip("needs TRITON_INTERPRET=1 (set by the tests' conftest without a GPU)")
    from kvfleet.engine.attention import register_attention_backend, torch_paged_attention
    from kvfleet.engine.attention.triton_backend import triton_paged_attention

    def attention(q: Any, k: Any, v: Any, kv_cache: Any, md: Any, scale: float, rotary: Any = None,
                  qk_norm: Any = None) -> Any:
        if md.max_query_len <= 1:   # decode-only: CUDA graphs on a GPU (compiled at capture); torch here, faster
            return torch_paged_attention(q, k, v, kv_cache, md, scale, rotary=rotary, qk_norm=qk_norm)
        return triton_paged_attention(q, k, v, kv_cache, md, scale, rotary=rotary, qk_norm=qk_norm)

    register_attention_backend("test-triton-recording", attention, device_types=("cpu",), priority=-100)
    monkeypatch.setenv("KVFLEET_ATTENTION_BACKEND", "test-triton-recording")
    recorder = VariantRecorder()
    recorder.install(monkeypatch)

    def make(**kw: Any) -> LLMEngine:
        cfg = dict(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu", num_kv_blocks=256,
                   max_model_len=192, max_num_seqs=16, max_num_batched_tokens=96)
        cfg.update(kw)
        return LLMEngine(EngineConfig(**cfg))

    return make, recorder


def _varied_workload(engine: LLMEngine, seed: int) -> None:
    """Staggered requests of many prompt lengths (1..80: chunked when over the 96-token budget with others),
    greedy and sampled, some sharing prefixes, n=2 and logprobs among them."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    shared = rng.integers(0, vocab, size=40).tolist()
    samplings = [dict(temperature=0.0), dict(temperature=1.0, top_p=0.8, seed=3), dict(temperature=0.5, top_k=5),
                 dict(temperature=0.0, logprobs=3), dict(temperature=0.9, n=2), dict(temperature=0.0,
                                                                                      presence_penalty=0.5)]
    n = 0
    for _wave in range(4):
        for _ in range(int(rng.integers(1, 5))):
            plen = int(rng.integers(1, 81))
            ids = (shared[:plen // 2] if rng.random() < 0.4 else []) + rng.integers(0, vocab, size=plen).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(1, 8)), ignore_eos=True,
                                    **samplings[int(rng.integers(0, len(samplings)))])
            engine.add_request(f"v{seed}-{n}", {"prompt_token_ids": ids[:150]}, params)
            n += 1
        for _ in range(int(rng.integers(1, 4))):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("async_scheduling,kernel", [(False, "v1"), (True, "v1"), (False, "v2")])
def test_warmup_covers_every_kernel_variant_of_a_varied_workload(triton_engine: Any, async_scheduling: bool,
                                                                 kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel)   # KVFLEET_PREFILL_KERNEL, read at import
    prefill_kernel = "_prefill_kernel" if kernel == "v1" else "_prefill_kernel_v2"
    make, recorder = triton_engine
    engine = make(async_scheduling=async_scheduling)
    recorder.keys.clear()   # start-up's own launches (the profiling forward) are not the warm-up's merit
    report = engine.warm_up()
    warmed = set(recorder.keys)
    assert report.requests == 8 and report.steps > 4   # 6, then a prompt decoding beside which a short one comes
    names = {k[0] for k in warmed}
    cache_write = "_rotary_cache_kernel" if triton_backend.FUSED_ROTARY_CACHE else "_reshape_and_cache_kernel"
    assert {prefill_kernel, "_decode_kernel", cache_write, "_shared_prefix_kernel"} <= names
    # decode rows of a mixed step that share a prefix fold its partial in (the SHARED variant)
    assert any(k[0] == "_decode_kernel" and dict((s[0], s[2]) for s in k[1])["SHARED"] for k in warmed)
    # a mixed step's one decode row of ~100 keys in two splits (4 "SMs" on a CPU), merged by the merge kernel
    assert any(k[0] == "_decode_kernel" and dict((s[0], s[2]) for s in k[1])["NUM_SPLITS"] == 2 for k in warmed)
    assert "_merge_kernel" in names
    # both prefill tiles, each alone and beside decode rows
    prefill = {(dict((s[0], s[2]) for s in k[1])["BLOCK_M"], dict((s[0], s[2]) for s in k[1])["SKIP_DECODE"])
               for k in warmed if k[0] == prefill_kernel}
    assert prefill == {(16, False), (32, False), (16, True), (32, True)}
    for seed in range(2):
        recorder.keys.clear()
        _varied_workload(engine, seed)
        missed = recorder.keys - warmed
        assert not missed, f"variants compiled after the warm-up: {sorted(missed)[:3]}"


def test_warmup_leaves_nothing_behind(tiny_model_factory: Any) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("qwen3")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=128))
    fresh = engine.stats()
    report = run_warmup(engine)
    assert report.requests == 6 and report.seconds > 0
    st = engine.stats()
    assert not engine.has_unfinished_requests() and not engine.groups
    assert st["kv_blocks_used"] == 0 and st["kv_blocks_cached"] == 0   # nothing in use, nothing cached
    assert st == fresh   # counters as a fresh engine's (the server's /metrics read these)
    assert not engine.runner._generators and not engine.runner._param_rows
    assert not engine.runner._token_histories
    engine.kv.check_invariants()
    engine.scheduler.check_invariants()
    # a real request afterwards finds no warm-up block in the prefix cache, and works
    engine.add_request("r", {"prompt_token_ids": list(range(1, 40))}, SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["prefix_cache_hits"] == 0


def test_warmup_refuses_a_busy_engine_and_plans_for_short_contexts(tiny_model_factory: Any) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=128))
    engine.add_request("busy", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="already has requests"):
        run_warmup(engine)
    for max_len in (16, 40, 4096):
        for wave in warmup_plan(max_len, 100):
            for r in wave.requests:
                assert r.prompt_len + r.max_tokens < max_len and r.prompt_len >= 1
    assert WARMUP_SALT
    assert [r.sampling.get("n", 1) for w in warmup_plan(128, 100, max_num_seqs=1) for r in w.requests] == [1] * 6


def test_warmup_plan_takes_a_long_prompt_beside_a_decode_where_it_fits() -> None:
    """Queries over SHORT_QUERY_MAX_TOKENS take another prefill tile: the plan brings one into a mixed step
    where the context and the step's budget let it in, and not otherwise."""
    from kvfleet.engine.attention.fresh_prompts import (
        GLUON_CHUNK_MIN_KEYS,
        GLUON_CHUNK_MIN_QUERY_TOKENS,
        long_prefix_chunks,
    )
    from kvfleet.engine.kernels.prefill_attention_v2 import SHORT_QUERY_MAX_TOKENS

    plan = warmup_plan(8448, 32000, 1024, 16384)
    assert len(plan) == 9
    decoding, long, chunk = plan[-3], plan[-2], plan[-1]
    assert decoding.steps == 1 and decoding.requests[0].max_tokens > 2   # still decoding when the long one comes
    beside, long_req = long.requests
    assert long_req.prompt_len > SHORT_QUERY_MAX_TOKENS and long.steps is None
    assert long_req.prompt_len + long_req.max_tokens < 8448
    assert 1 < beside.prompt_len <= SHORT_QUERY_MAX_TOKENS   # rows for the Triton kernel beside the Gluon one
    # then a chunk over the long prompt's cached tokens, of the shape the paged Gluon kernel takes
    req = chunk.requests[0]
    assert req.reuse_prefix == long_req.prompt_len and req.prompt_len + req.max_tokens < 8448
    cached = req.reuse_prefix // 16 * 16   # whole blocks
    assert long_prefix_chunks([0, req.prompt_len - cached], [req.prompt_len]) == [True]
    assert req.prompt_len - cached >= GLUON_CHUNK_MIN_QUERY_TOKENS and req.prompt_len >= GLUON_CHUNK_MIN_KEYS
    assert len(warmup_plan(SHORT_QUERY_MAX_TOKENS + 200, 32000, 1024, 16384)) == 8   # room for the long one only
    assert len(warmup_plan(8448, 32000, 1024, SHORT_QUERY_MAX_TOKENS)) == 6   # the budget chunks it short
    # a budget that takes the long prompt whole but not the short one beside it: the long one alone
    assert len(warmup_plan(8448, 32000, 1024, long_req.prompt_len)[-2].requests) == 1
    assert len(warmup_plan(SHORT_QUERY_MAX_TOKENS, 32000, 1024, 16384)) == 6   # the context cannot hold it
    assert len(warmup_plan(128, 100)) == 6


class _NoFitGraphs:
    """Stands in for captured graphs that fit no step: what the warm-up does when graphs exist (CUDA)."""

    def can_run(self, num_tokens: int, attn_metadata: Any) -> bool:
        return False


def test_warmup_runs_its_plan_again_eagerly_where_graphs_were_captured(tiny_model_factory: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that fit no graph launch the eager kernel variants: with graphs the plan runs once replayed, once
    with every forward eager, and leaves the runner replaying again."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=128))
    executor = engine.runner.executor
    seen: list[bool] = []
    real = executor.forward

    def forward(*a: Any, eager: bool = False, **kw: Any) -> Any:
        seen.append(eager)
        return real(*a, eager=eager, **kw)

    monkeypatch.setattr(executor, "forward", forward)
    assert run_warmup(engine).requests == 6 and not seen.count(True)   # no graphs: one pass, never forced
    seen.clear()
    monkeypatch.setattr(executor, "graphs", _NoFitGraphs())
    report = run_warmup(engine)
    assert report.requests == 12
    assert seen.count(False) == seen.count(True) > 0 and seen.index(True) > seen.index(False)
    assert engine.runner.eager_forward is False and engine.stats()["kv_blocks_used"] == 0


def test_warmup_of_an_engine_of_one_sequence_at_a_time(tiny_model_factory: Any) -> None:
    """`--max-num-seqs 1` refuses n=2: the warm-up's parallel-sampling request asks for what fits."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=128, max_num_seqs=1))
    report = engine.warm_up()
    assert report.requests == 6 and not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_used"] == 0


def test_warm_logits_computes_every_row_count_a_step_can_sample(tiny_model_factory: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """cuBLAS loads a matmul kernel per row count on first use (run_warmup calls this on CUDA): every count
    from 1 to max_rows goes through the executor's own compute_logits, whose rows match the model's."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=128, max_num_seqs=6))
    executor, mc = engine.runner.executor, engine.model_config
    rows: list[tuple[int, int]] = []
    real = executor.compute_logits

    def compute_logits(hidden: Any) -> Any:
        out = real(hidden)
        rows.append((hidden.shape[0], out.shape[0]))
        assert out.shape[1] >= mc.vocab_size
        return out

    monkeypatch.setattr(executor, "compute_logits", compute_logits)
    secs = warm_logits(executor, 6, mc.hidden_size, mc.dtype, engine.device)
    assert rows == [(m, m) for m in range(1, 7)] and secs >= 0


def test_warmup_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLEET_WARMUP: unset or auto, the plan on CUDA only; 1 and 0 as set, on any device."""
    monkeypatch.delenv("KVFLEET_WARMUP", raising=False)
    assert warmup_runs_plan("cuda") and not warmup_runs_plan("cpu")
    assert warmup_runs_plan("cuda", "auto") and not warmup_runs_plan("cpu", "")
    monkeypatch.setenv("KVFLEET_WARMUP", "1")
    assert warmup_runs_plan("cpu")
    monkeypatch.setenv("KVFLEET_WARMUP", "0")
    assert not warmup_runs_plan("cuda")
    monkeypatch.setenv("KVFLEET_WARMUP", "maybe")
    with pytest.raises(ValueError, match="KVFLEET_WARMUP"):
        warmup_runs_plan("cuda")


def test_health_is_503_until_the_warmup_ran(tiny_model_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's load path with a slow warm-up: /health and the API answer 503 while it runs, 200 after."""
    import httpx

    from kvfleet.engine.async_llm import AsyncLLM
    from kvfleet.engine.server.app import build_app
    from kvfleet.engine.server.state import ServerState

    model = str(tiny_model_factory("llama"))
    calls: list[str] = []
    real = LLMEngine.warm_up

    def slow_warm_up(self: LLMEngine, plan: Any = None) -> Any:
        calls.append("start")
        time.sleep(1.0)
        out = real(self, plan)
        calls.append("done")
        return out

    monkeypatch.setattr(LLMEngine, "warm_up", slow_warm_up)
    monkeypatch.setenv("KVFLEET_WARMUP", "1")   # the plan on this CPU too (by default only on CUDA)
    state = ServerState(model_name="tiny", model_path=model, keys=None)
    app = build_app(state, lambda: AsyncLLM(model, dtype="float32", device="cpu", num_kv_blocks=64,
                                            max_model_len=128))

    async def scenario() -> list[tuple[int, str]]:
        seen: list[tuple[int, str]] = []
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    r = await client.get("/health")
                    seen.append((r.status_code, "done" if "done" in calls else
                                 ("running" if calls else "loading")))
                    if r.status_code == 200:
                        break
                    api = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2],
                                                                     "max_tokens": 2})
                    assert api.status_code == 503
                    await asyncio.sleep(0.05)
                ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3],
                                                                "max_tokens": 2})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
                stats = state.engine.stats()
                assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
        return seen

    seen = asyncio.run(scenario())
    assert seen[-1][0] == 200 and seen[-1][1] == "done"
    assert (503, "running") in seen   # not ready while the warm-up ran
    assert all(code == 503 for code, _ in seen[:-1])


def test_a_cpu_server_is_ready_after_one_real_step_without_the_plan(tiny_model_factory: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a CPU replica skips the plan (nothing to compile there: it only delayed /health): the load path
    runs one real one-token step, then serves, and leaves nothing behind."""
    import httpx

    from kvfleet.engine.async_llm import AsyncLLM
    from kvfleet.engine.server.app import build_app
    from kvfleet.engine.server.state import ServerState
    from kvfleet.engine.warmup import ONE_STEP_PLAN

    monkeypatch.delenv("KVFLEET_WARMUP", raising=False)
    reports: list[Any] = []
    real = LLMEngine.warm_up

    def recorded_warm_up(self: LLMEngine, plan: Any = None) -> Any:
        reports.append((plan, real(self, plan)))
        return reports[-1][1]

    monkeypatch.setattr(LLMEngine, "warm_up", recorded_warm_up)
    state = ServerState(model_name="tiny", model_path=str(tiny_model_factory("llama")), keys=None)
    app = build_app(state, lambda: AsyncLLM(str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                            num_kv_blocks=64, max_model_len=128))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                deadline = time.monotonic() + 120
                while (await client.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, "never ready"
                    await asyncio.sleep(0.05)
                stats = state.engine.stats()   # the step's tokens are not counted as served
                assert stats["prompt_tokens"] == 0 and stats["generation_tokens"] == 0
                ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3],
                                                                "max_tokens": 2})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
                stats = state.engine.stats()
                assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0

    asyncio.run(scenario())
    (plan, report), = reports   # before /health said ready: one real step, not the plan
    assert plan is ONE_STEP_PLAN and report.requests == 1 and report.steps >= 1


def test_compile_counter_counts_triton_kernel_loads_not_compile_hooks(caplog: pytest.LogCaptureFixture) -> None:
    """The counter joins Triton's kernel-load chain (called as each compiled kernel is first launched, Gluon's too)
    and leaves the post-compile hook unset: Triton serializes constexpr arguments before that one, and cannot
    serialize the Gluon kernels' layouts (a chunk's step failed on the H200 with it set, issue 16 lease 14)."""
    from triton import knobs

    from kvfleet.engine.warmup import _CompileCounter

    counter = _CompileCounter()
    try:
        assert counter.install() and counter.install()   # once
        assert knobs.runtime.jit_post_compile_hook is None
        assert knobs.runtime.kernel_load_end_hook.calls.count(counter._loaded) == 1
        # what triton.compiler.CompiledKernel._init_handles calls after loading a kernel's module
        knobs.runtime.kernel_load_end_hook(None, None, "_prefill_kernel_v2", {}, "ab" * 32)
        assert (counter.count, counter.after_ready) == (1, 0)
        counter.serving()
        with caplog.at_level("WARNING", logger="kvfleet.engine.warmup"):
            knobs.runtime.kernel_load_end_hook(None, None, "_gluon_paged_kernel", {}, "cd" * 32)
        assert (counter.count, counter.after_ready) == (2, 1)
        assert "while serving" in caplog.text and "_gluon_paged_kernel" in caplog.text
    finally:
        knobs.runtime.kernel_load_end_hook.remove(counter._loaded)


def test_warmup_prompt_reuses_the_previous_prompt_as_asked() -> None:
    from kvfleet.engine.warmup import WarmupRequest, warmup_prompt

    rng = np.random.default_rng(0)
    first = warmup_prompt(rng, 100, WarmupRequest(40, 2), [])
    second = warmup_prompt(rng, 100, WarmupRequest(50, 2, reuse_prefix=32), first)
    assert len(first) == 40 and len(second) == 50 and second[:32] == first[:32] and second[32:] != first[32:]
    with pytest.raises(ValueError, match="reuse_prefix 64"):
        warmup_prompt(rng, 100, WarmupRequest(80, 2, reuse_prefix=64), first)


def test_warmup_runs_a_chunk_over_a_cached_prefix(tiny_model_factory: Any) -> None:
    """Plan step 8 through a real engine: the prompt that reuses the long one's tokens finds them in the prefix
    cache, so its step is a chunk over cached keys; nothing is left cached afterwards."""
    from kvfleet.engine.warmup import WarmupRequest, Wave

    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, max_model_len=256, block_size=16))
    plan = [Wave((WarmupRequest(100, 2, {"temperature": 0.0}),), None),
            Wave((WarmupRequest(140, 2, {"temperature": 0.0}, reuse_prefix=100),), None)]
    report = run_warmup(engine, plan)
    assert report.prefix_cache_hits == 96   # the 6 full blocks of the first prompt
    assert engine.stats()["kv_blocks_cached"] == 0 and engine.stats()["prefix_cache_hits"] == 0


def test_warmup_runs_the_long_tile_beside_decode_rows_with_rows_for_the_triton_kernel(tiny_model_factory: Any,
                                                                                      monkeypatch: pytest.MonkeyPatch
                                                                                      ) -> None:
    """Plan step 7 through a real engine (the plan as on CUDA, its steps on the CPU): one step holds a decode row, a
    fresh prompt long enough for the Gluon kernel, and a prompt of more than one token that the Triton prefill kernel
    attends for, with the long-query tile that step's longest query picks (lease 23: without the short prompt the
    Triton kernel had no rows there, and chat-mix compiled that variant on a request's time)."""
    import torch

    from kvfleet.engine.attention import register_attention_backend, torch_paged_attention
    from kvfleet.engine.attention.fresh_prompts import fresh_long_prompts
    from kvfleet.engine.kernels.prefill_attention_v2 import SHORT_QUERY_MAX_TOKENS, default_tile_v2

    steps: list[tuple[list[int], list[int]]] = []   # (query_start_loc, seq_lens) of each step with a prompt

    def attention(q: Any, k: Any, v: Any, kv_cache: Any, md: Any, scale: float, rotary: Any = None,
                  qk_norm: Any = None) -> Any:
        if md.max_query_len > 1:
            steps.append((list(md.query_start_loc_cpu), list(md.seq_lens_cpu)))
        return torch_paged_attention(q, k, v, kv_cache, md, scale, rotary=rotary, qk_norm=qk_norm)

    register_attention_backend("test-step-recording", attention, device_types=("cpu",), priority=-100)
    monkeypatch.setenv("KVFLEET_ATTENTION_BACKEND", "test-step-recording")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama", max_position_embeddings=4608)),
                                    dtype="float32", device="cpu", num_kv_blocks=512, max_model_len=4608,
                                    max_num_seqs=16, max_num_batched_tokens=8192))
    plan = warmup_plan(4608, engine.model_config.vocab_size, 16, 8192)
    steps.clear()   # start-up's profiling forward
    run_warmup(engine, plan)

    def triton_rows_beside_gluon_and_decodes(qsl: list[int], seq_lens: list[int]) -> bool:
        q_lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
        gluon = fresh_long_prompts(qsl, seq_lens)
        triton_prompts = [n for n, g in zip(q_lens, gluon, strict=True) if not g and n > 1]
        long_tile = default_tile_v2(max(q_lens), torch.bfloat16) == default_tile_v2(SHORT_QUERY_MAX_TOKENS + 1,
                                                                                    torch.bfloat16)
        return any(gluon) and bool(triton_prompts) and 1 in q_lens and long_tile

    assert any(triton_rows_beside_gluon_and_decodes(*s) for s in steps), steps
    assert engine.stats()["kv_blocks_used"] == 0


def test_split_waves_send_each_count_its_decode_rows_then_a_prompt_beside_them() -> None:
    # contexts for 16 splits of 64 keys, half a split short of 1,024; fewer where max_model_len is short; none at 1
    assert split_context(8448, 16, 64) == 992
    assert split_context(192, 16, 64) == 96
    assert split_context(100, 16, 64) == 0
    greedy = {"temperature": 0.0}
    beside = Wave((WarmupRequest(SPLIT_WAVE_PROMPT_TOKENS, 2, greedy),), None)
    # prefill steps of each wave's prompts at 8,192 tokens a step, then two; its decodes outlast the prompt beside
    assert split_waves({16: 1, 4: 5}, 992, 8448, 8192) == [
        Wave((WarmupRequest(992, 7, greedy),) * 5, 3), beside, Wave((WarmupRequest(992, 7, greedy),), 3), beside]
    assert split_waves({2: 11}, 992, 8448, 2048) == [Wave((WarmupRequest(992, 12, greedy),) * 11, 8), beside]
    assert split_waves({2: 1}, 96, 100, 96) == []   # 96 + 3 steps + 4 tokens past max_model_len
