"""Async scheduling (kvfleet.engine.async_step): the same outputs as the synchronous engine.

With `async_scheduling=True` the engine schedules and prepares step N+1 while step N runs (decode
inputs are placeholders filled on the device from step N's samples) and processes step N's outputs
while N+1 runs, so a request that stops at N (stop id, EOS, stop string) was already planned in N+1:
these tests check that its extra token never reaches the output and no block or row is left held,
that the overlap really happens, and that every other rule (greedy tokens vs transformers under
chunked prefill, prefix hits and preemption, also of a sequence whose token is in flight; stop ids,
max/min tokens; seeded sampling; n>1, beam search and prompt logprobs, whose groups skip the
placeholder planning) gives exactly what the synchronous engine gives.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from kvfleet.engine import LLM, AsyncLLM, SamplingParams
from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, may_continue
from kvfleet.engine.model_runner import ModelRunner
from kvfleet.engine.sampling_params import StructuredOutputsParams

PROMPT_LENS = (3, 16, 17, 33, 41)
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)


def prompts_for(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def summary(outs) -> list:
    """Everything a user sees of a batch of outputs."""
    return [[(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              c.logprobs) for c in o.outputs] + [o.prompt_logprobs] for o in outs]


def assert_no_leak(llm: LLM) -> None:
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    eng = llm.llm_engine
    eng.kv.check_invariants()
    assert eng.kv.pool.num_free_blocks == s["kv_blocks_total"]
    assert not eng.groups and eng._inflight is None
    assert not eng.runner._block_rows.row_of and not eng.runner._generators and not eng.runner._param_rows
    assert not eng.runner._token_histories
    # Blocks are hashed only once their token ids are known: every cached block is a full one.
    bs = eng.kv.block_size
    assert all(t is None or len(t) == bs for t in eng.kv.pool.block_tokens)


def count_preempted_in_flight(monkeypatch) -> list[int]:
    """Counts sequences preempted while their sampled token was in flight (their token is kept)."""
    orig, seen = Scheduler.update_from_output, [0]

    def update(self, sched, result):
        seen[0] += sum(s.needs_sample and s.request.status is RequestStatus.PREEMPTED for s in sched.scheduled)
        return orig(self, sched, result)

    monkeypatch.setattr(Scheduler, "update_from_output", update)
    return seen


@pytest.fixture(scope="module")
def refs(tiny_model_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompts = prompts_for(hf.config.vocab_size)
    with torch.no_grad():
        ids = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return prompts, ids


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(synchronous, async) engines over the same tiny model and settings."""
    kw = dict(num_kv_blocks=96, max_num_batched_tokens=64)
    return LLM(str(tiny_model_dir), async_scheduling=False, **kw), LLM(str(tiny_model_dir), async_scheduling=True, **kw)


def test_greedy_matches_transformers_with_chunks_prefix_hits_and_preemption(tiny_model_dir, refs,
                                                                           monkeypatch) -> None:
    in_flight = count_preempted_in_flight(monkeypatch)
    prompts, ref_ids = refs
    llm = LLM(str(tiny_model_dir), max_num_batched_tokens=16, num_kv_blocks=64, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref_ids
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref_ids   # prefix hits
    assert llm.stats()["prefix_cache_hits"] == 16 + 32 + 32
    assert_no_leak(llm)
    # Room for the longest request alone but not for the batch: preemption, then recompute.
    need = math.ceil((max(PROMPT_LENS) + MAX_NEW) / 8)
    kw = dict(block_size=8, num_kv_blocks=need + 2, enable_prefix_caching=False)
    small = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    outs = small.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref_ids
    assert small.stats()["num_preemptions"] > 0
    sync = LLM(str(tiny_model_dir), **kw)
    assert summary(sync.generate(prompts, GREEDY)) == summary(outs)
    assert_no_leak(small)
    # Seeded random sampling under the same preemptions: each sequence's generator advances once
    # per sampled token, also for a token sampled just before its sequence was preempted.
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    assert summary(sync.generate(prompts, seeded)) == summary(small.generate(prompts, seeded))
    assert in_flight[0] > 0    # a sequence was preempted with its token in flight, and kept it
    assert_no_leak(small)


def test_stop_rules_exact(pair, tiny_model_dir) -> None:
    sync, fast = pair
    tok = sync.get_tokenizer()
    texts = ["the quick brown fox", "hello world, this is", "a b c d e f g", "once upon a time there"]
    free = sync.generate(texts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # Stop strings and ids taken from what greedy decoding really produces, so they do fire.
    stop_str = [o.outputs[0].text[3:5] or "e" for o in free]
    stop_ids = [o.outputs[0].token_ids[4] for o in free]
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop=[s]) for s in stop_str]
    params += [SamplingParams(temperature=0.0, max_tokens=12, stop=[s], include_stop_str_in_output=True)
               for s in stop_str]
    params += [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[i]) for i in stop_ids]
    params += [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[i], min_tokens=7) for i in stop_ids]
    params += [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9)]
    prompts = texts * 5
    a = sync.generate(prompts, params)
    # Count the requests a step had scheduled that were finished before its update (late stops).
    sch = fast.llm_engine.scheduler
    orig, late = sch.update_from_output, [0]

    def update(sched, result):
        late[0] += sum(s.request.status is not RequestStatus.RUNNING for s in sched.scheduled)
        return orig(sched, result)

    sch.update_from_output = update
    try:
        b = fast.generate(prompts, params)
    finally:
        del sch.update_from_output
    assert late[0] > 0              # the one-step-late stop string path really ran
    assert summary(a) == summary(b)
    reasons = {c.finish_reason for o in b for c in o.outputs}
    assert reasons == {"stop", "length"}
    # The stop strings really fired and truncated (a late stop adds no token and no text).
    for o, s in zip(b[:4], stop_str, strict=True):
        assert o.outputs[0].finish_reason == "stop" and s not in o.outputs[0].text
        assert len(tok.encode(o.outputs[0].text)) <= len(o.outputs[0].token_ids) + 1
    assert_no_leak(fast)


def test_seeded_sampling_n_beam_and_prompt_logprobs_same_as_sync(pair) -> None:
    sync, fast = pair
    prompts = prompts_for(500, (5, 20, 37), seed=4)
    cases = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=15, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.1, n=3, seed=5, max_tokens=8, ignore_eos=True,
                       repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, logprobs=1),
        SamplingParams(temperature=0.7, best_of=3, n=1, seed=2, max_tokens=7),
    ]
    for p in cases:
        assert summary(sync.generate(prompts, p)) == summary(fast.generate(prompts, p)), p
        assert_no_leak(fast)


def test_no_leak_after_abort_and_abort_output_has_every_token(pair) -> None:
    _, fast = pair
    eng = fast.llm_engine
    prompts = prompts_for(500, (5, 20, 37, 64), seed=0)
    eng.add_request("a", prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("b", prompts[1], SamplingParams(n=3, max_tokens=12, temperature=0.8, seed=3))
    eng.add_request("c", prompts[2], SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request("d", prompts[3], SamplingParams(use_beam_search=True, best_of=2, max_tokens=6))
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None         # a launched step is really in flight
    seq = eng.groups["c"].seqs[0].seq
    have = list(seq.output_token_ids)
    assert len(have) > 0
    (out,) = eng.abort_request(["c"])
    assert out.finished and out.outputs[0].token_ids == have
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leak(fast)


def test_next_step_is_scheduled_and_prepared_before_the_last_ids_are_read(tiny_model_dir) -> None:
    """The overlap itself: fails if the engine silently went synchronous."""
    prompts = prompts_for(500, (5, 9, 20), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=64)
    fast = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    sync = LLM(str(tiny_model_dir), async_scheduling=False, **kw)
    eng, runner = fast.llm_engine, fast.llm_engine.runner
    events: list[str] = []
    def recording(name: str, method: Any) -> Any:
        def hook(*a: Any, **k: Any) -> Any:
            events.append(name)
            return method(*a, **k)
        return hook

    for obj, name in ((eng.scheduler, "schedule"), (runner, "prepare"), (runner, "launch"), (runner, "collect")):
        setattr(obj, name, recording(name, getattr(obj, name)))
    assert summary(fast.generate(prompts, params)) == summary(sync.generate(prompts, params))
    # Every decode token after the first is fed from the last step's samples on the device.
    assert runner.num_placeholder_inputs == len(prompts) * (params.max_tokens - 1)
    assert sync.llm_engine.runner.num_placeholder_inputs == 0
    # Step N+1 is scheduled, prepared and launched after step N's launch and before its ids are collected.
    i = events.index("launch")
    assert events[i:i + 5] == ["launch", "schedule", "prepare", "launch", "collect"]
    assert eng.num_overlapped_steps == params.max_tokens - 1
    assert eng.num_launched_ahead == params.max_tokens - 1
    assert_no_leak(fast)
    # Penalties count the token in flight on the device: launched ahead too, the same tokens.
    events.clear()
    eng.num_overlapped_steps = eng.num_launched_ahead = 0
    penalized = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5)
    assert summary(fast.generate(prompts, penalized)) == summary(sync.generate(prompts, penalized))
    i = events.index("launch")
    assert events[i:i + 5] == ["launch", "schedule", "prepare", "launch", "collect"]
    assert eng.num_launched_ahead == penalized.max_tokens - 1
    assert_no_leak(fast)
    # A grammar's next mask needs the token it has not taken: that step waits for N's ids, launched after them.
    events.clear()
    eng.num_overlapped_steps = eng.num_launched_ahead = 0
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="[a-f]{40}"))
    assert summary(fast.generate(prompts, constrained)) == summary(sync.generate(prompts, constrained))
    i = events.index("launch")
    assert events[i:i + 5] == ["launch", "schedule", "prepare", "collect", "launch"]
    assert eng.num_overlapped_steps > 0 and eng.num_launched_ahead == 0
    assert_no_leak(fast)


def test_penalties_launched_ahead_count_the_token_in_flight(tiny_model_dir) -> None:
    """Launched ahead, a sequence's token of the step before is not appended yet: the penalties take it from the
    device, so greedy penalized outputs equal the synchronous engine's (repetition, frequency and presence, mixed
    with unpenalized rows and seeded sampling) and every step after the first is launched ahead."""
    kw = dict(num_kv_blocks=96, max_num_batched_tokens=64)
    fast = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    sync = LLM(str(tiny_model_dir), async_scheduling=False, **kw)
    prompts = prompts_for(500, (4, 11, 23, 30), seed=12)
    cases = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, repetition_penalty=1.4),
    ]
    for p in cases:
        fast.llm_engine.num_launched_ahead = 0
        assert summary(fast.generate(prompts, p)) == summary(sync.generate(prompts, p)), p
        assert fast.llm_engine.num_launched_ahead >= p.max_tokens - 1
        assert_no_leak(fast)
    mixed = [cases[0], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), cases[2], cases[3]]
    assert summary(fast.generate(prompts, mixed)) == summary(sync.generate(prompts, mixed))
    unpenalized = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert summary(unpenalized) != summary(sync.generate(prompts, cases[0]))   # the penalty changes the tokens
    assert_no_leak(fast)


def test_min_tokens_counts_the_token_in_flight_when_launched_ahead(tiny_model_dir) -> None:
    """Launched ahead, a sequence's token of the step before is not appended yet: min_tokens still bans its stop
    ids for exactly min_tokens tokens (a stop id that greedy decoding picks at once, so the ban decides)."""
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=64)
    fast = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    sync = LLM(str(tiny_model_dir), async_scheduling=False, **kw)
    prompts = prompts_for(500, (4, 11, 23), seed=7)
    free = sync.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for n in (1, 2, 3, 5):
        # each prompt's own greedy token n-1 stops it; with min_tokens = n it is allowed only from token n on
        params = [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=n,
                                 stop_token_ids=list(set(o.outputs[0].token_ids)))
                  for o in free]
        a, b = sync.generate(prompts, params), fast.generate(prompts, params)
        assert summary(a) == summary(b)
        assert all(len(o.outputs[0].token_ids) >= n for o in b)
    assert fast.llm_engine.num_launched_ahead > 0
    assert_no_leak(fast)


def test_forward_ahead_queues_the_forward_and_samples_after_the_tokens_are_taken(tiny_model_dir) -> None:
    """KVFLEET_FORWARD_AHEAD: a step whose sampler reads the tokens in flight (a penalty, a regex, prompt logprobs)
    has its forward queued before those tokens are collected and is sampled after the scheduler takes them: the same
    outputs as the synchronous engine. A sequence that those tokens end (a stop id) is forwarded but not sampled:
    its generator, parameters and grammar are gone, nothing is left behind."""
    kw = dict(num_kv_blocks=96, max_num_batched_tokens=64)
    fast = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    sync = LLM(str(tiny_model_dir), async_scheduling=False, **kw)
    eng, runner = fast.llm_engine, fast.llm_engine.runner
    eng.forward_ahead = True
    events: list[str] = []
    ended_before_sampling, sampled_after_end = [0], [0]

    def recording(name: str, method: Any) -> Any:
        def hook(*a: Any, **k: Any) -> Any:
            events.append(name)
            out = method(*a, **k)
            if name == "sample_step":
                ended_before_sampling[0] += sum(s.request.is_finished for s in a[0].reqs)
                sampled_after_end[0] += sum(s.request.is_finished for s in out.reqs)
            return out
        return hook

    for name in ("forward_step", "sample_step", "collect"):
        setattr(runner, name, recording(name, getattr(runner, name)))
    prompts = prompts_for(500, (4, 11, 23), seed=9)
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="[a-f]{40}"))
    assert summary(fast.generate(prompts, constrained)) == summary(sync.generate(prompts, constrained))
    i = events.index("collect")
    assert events[i - 1:i + 2] == ["forward_step", "collect", "sample_step"]   # forward before, sampler after
    assert eng.num_forwarded_ahead == constrained.max_tokens - 1 and eng.num_launched_ahead == 0
    assert_no_leak(fast)
    cases = [
        SamplingParams(temperature=0.9, seed=4, max_tokens=9, ignore_eos=True, presence_penalty=0.7, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="[a-f]{6}")),
    ]
    for p in cases:
        assert summary(sync.generate(prompts, p)) == summary(fast.generate(prompts, p)), p
        assert_no_leak(fast)
    # Each prompt's own (constrained, seeded) token 3 is a stop id: N's tokens end it while N+1 is forwarded.
    regex = StructuredOutputsParams(regex="[a-f]{40}")
    seeded = SamplingParams(temperature=1.0, seed=6, max_tokens=12, ignore_eos=True, structured_outputs=regex)
    free = sync.generate(prompts, seeded)
    assert all(len(o.outputs[0].token_ids) > 3 for o in free)
    stops = [SamplingParams(temperature=1.0, seed=6, max_tokens=12, structured_outputs=regex,
                            stop_token_ids=[o.outputs[0].token_ids[3]]) for o in free]
    eng.num_forwarded_ahead = 0
    a, b = sync.generate(prompts, stops), fast.generate(prompts, stops)
    assert summary(a) == summary(b)
    assert all(len(o.outputs[0].token_ids) <= 4 and o.outputs[0].finish_reason == "stop" for o in b)
    assert eng.num_forwarded_ahead > 0
    assert ended_before_sampling[0] > 0 and sampled_after_end[0] == 0   # forwarded, then ended: not sampled
    assert_no_leak(fast)


def test_which_steps_wait_for_the_token_values_in_flight() -> None:
    """Launching ahead is skipped only where the sampler reads token values on the host: prompt logprobs while the
    prompt is computed (a grammar's: `TokenGrammar.needs_last_token`). Penalties take the token in flight on the
    device."""
    def step(params: SamplingParams, start: int, needs_sample: bool) -> SchedulerOutput:
        req = Request("a#0", list(range(1, 9)), max_tokens=4, sampling_params=params)
        return SchedulerOutput([ScheduledRequest(req, start, 1 if start else 8, [0], needs_sample)])

    plain = SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[3])
    penalized = SamplingParams(presence_penalty=0.5)
    plp = SamplingParams(prompt_logprobs=1)
    assert not ModelRunner.needs_token_values(step(plain, 8, True))
    assert not ModelRunner.needs_token_values(step(penalized, 8, True))
    assert not ModelRunner.needs_token_values(step(penalized, 0, False))   # a prompt chunk: nothing sampled
    assert ModelRunner.needs_token_values(step(plp, 0, True))
    assert not ModelRunner.needs_token_values(step(plp, 8, True))          # decoding: its prompt is done
    assert not ModelRunner.needs_token_values(SchedulerOutput())


def test_placeholders_only_for_sequences_that_may_go_on() -> None:
    req = Request("a#0", [1, 2, 3], max_tokens=2)
    assert may_continue(req, max_model_len=100)     # the token planned now is its 1st of 2
    req.num_placeholders = 1                        # one in flight: the one planned now is its last
    assert not may_continue(req, max_model_len=100)
    assert not may_continue(Request("b#0", [1, 2, 3], max_tokens=9), max_model_len=4)
    assert not may_continue(Request("c#0", [1, 2], max_tokens=9, external_tokens=True), 100)   # beam
    assert not may_continue(Request("d#0", [1, 2], max_tokens=9, compute_limit=1), 100)        # fork parent


def test_async_llm_streams_with_async_scheduling(tiny_model_dir) -> None:
    prompts = [[5, 6, 7], list(range(10, 40)), [99] * 17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = AsyncLLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, async_scheduling=True)

    async def one(p, i):
        return [o async for o in engine.generate(p, params, f"s{i}")]

    async def main():
        try:
            return await asyncio.gather(*[one(p, i) for i, p in enumerate(prompts)])
        finally:
            await engine.shutdown()

    streams = asyncio.run(main())
    offline = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256).generate(prompts, params)
    for outs, ref in zip(streams, offline, strict=True):
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == 12
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text


def test_config_rejects_non_bool(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_model_dir), async_scheduling="yes")


def test_throughput_bench_with_async_scheduling(tiny_model_dir, tmp_path) -> None:
    import json

    from kvfleet.engine.bench.throughput import main
    from kvfleet.engine.bench.workloads import BenchRequest, write_jsonl

    reqs = [BenchRequest(list(range(3 + i, 20 + 2 * i)), 3 + i % 4) for i in range(5)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    out = tmp_path / "r.json"
    assert main(["--model", str(tiny_model_dir), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out),
                 "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32", "--warmup-requests", "1",
                 "--async-scheduling", "--profile-host", str(tmp_path / "prof.txt")]) == 0
    res = json.loads(out.read_text())
    assert res["args"]["async_scheduling"] is True and res["requests_with_wrong_length"] == 0
    assert res["async_scheduling"] is True
    assert "llm_engine.py" in (tmp_path / "prof.txt").read_text()   # the timed run's host profile
    assert res["output_tokens"] == sum(r.max_tokens for r in reqs)
    decode = res["step_breakdown_ms"]["decode"]
    assert decode["steps"] > 0 and decode["prepare_ms"] >= 0 and decode["wait_ms"] >= 0
    assert decode["prepare_async_ms"] > 0 and decode["outputs_ms"] >= 0   # the async path's inputs, apart


@pytest.mark.parametrize("broken", ["launch", "collect", "forward_step", "sample_step"])
def test_a_failing_step_ends_its_requests_and_the_rest_goes_on(tiny_model_dir, broken) -> None:
    """A failure while step N+1 is planned on step N ends the requests of both (a request admitted
    in N+1 was advanced by the scheduler but never computed); the engine goes on. The halves of a forwarded-ahead
    step (a grammar: forward before N's tokens are read, sampler after) alike."""
    halves = broken in ("forward_step", "sample_step")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, structured_outputs=StructuredOutputsParams(
        regex="[a-f]{40}") if halves else None)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, async_scheduling=True)
    eng = llm.llm_engine
    eng.forward_ahead = halves
    eng.add_request("in-step", [1, 2, 3], greedy)
    eng.step()                                 # in-step's prefill is launched (step N)
    eng.add_request("joins", [7, 8, 9, 10], greedy)   # admitted in step N+1
    real = getattr(eng.runner, broken)

    def fail(*a, **k):
        raise RuntimeError("injected")

    setattr(eng.runner, broken, fail)
    with pytest.raises(RuntimeError, match="step failed for 2 request"):
        eng.step()
    setattr(eng.runner, broken, real)
    assert not eng.groups and eng.stats()["kv_blocks_used"] == 0 and eng._inflight is None
    eng.add_request("after", [4, 5, 6], greedy)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(eng.step())
    ref = LLM(str(tiny_model_dir), num_kv_blocks=64).generate([[4, 5, 6]], greedy)
    assert outs[-1].request_id == "after" and outs[-1].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert_no_leak(llm)
