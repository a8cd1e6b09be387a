"""AsyncLLM (what the server sits on) and the stop rules seen through it."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet.engine import LLM, AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = AsyncLLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256)
    yield eng
    asyncio.run(eng.shutdown())


def collect(engine: AsyncLLM, prompt, params: SamplingParams, rid: str):
    async def run():
        return [o async for o in engine.generate(prompt, params, rid)]
    return run()


def test_concurrent_streams_are_cumulative_and_match_offline(engine: AsyncLLM, tiny_model_dir) -> None:
    prompts = [[5, 6, 7], list(range(10, 40)), [99] * 17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*[collect(engine, p, params, f"c{i}") for i, p in enumerate(prompts)])

    streams = asyncio.run(main())
    offline = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=256).generate(prompts, params)
    for outs, ref in zip(streams, offline, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == 12
        texts = [o.outputs[0].text for o in outs]
        assert all(texts[-1].startswith(t) for t in texts)          # text only grows at its end
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    s = engine.stats()
    assert s["kv_blocks_used"] == 0 and s["generation_tokens"] >= 36


def test_accepted_requests_count_as_waiting_before_the_engine_thread_takes_them(engine: AsyncLLM) -> None:
    # num_requests_waiting is the autoscaler's signal: a request accepted by generate() but not yet
    # handed to the engine thread is waiting too. Hold the engine thread in a command to see that window.
    import threading

    gate = threading.Event()
    engine._commands.put(lambda: gate.wait(10))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def main():
        tasks = [asyncio.create_task(collect(engine, [3, 4, 5 + i], params, f"w{i}")) for i in range(5)]
        deadline = time.monotonic() + 10                 # until each generator has queued its request (bounded)
        while sum(engine.stats()[k] for k in ("num_waiting", "num_running")) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        held = engine.stats()
        released_at = time.monotonic()
        gate.set()
        outs = await asyncio.gather(*tasks)
        return held, outs, released_at

    held, outs, released_at = asyncio.run(main())
    assert held["num_waiting"] + held["num_running"] == 5, held
    assert all(o[-1].finished for o in outs)
    # arrival is when generate() accepted the request, so the server's queue time and TTFT include the wait
    # for the engine thread (as vLLM's, stamped in its API server, do)
    for o in outs:
        m = o[-1].metrics
        assert m.arrival_time < released_at <= m.first_scheduled_time, m
    after = engine.stats()
    assert after["num_waiting"] == 0 and after["num_running"] == 0


def test_abort_frees_blocks_at_once(engine: AsyncLLM) -> None:
    async def main():
        gen = engine.generate(list(range(1, 60)), SamplingParams(max_tokens=150, ignore_eos=True), "long")
        first = await gen.__anext__()
        assert not first.finished and engine.stats()["kv_blocks_used"] >= 4
        await engine.abort("long")
        assert engine.stats()["kv_blocks_used"] == 0
        rest = [o async for o in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())


def test_a_failing_step_fails_its_requests_not_the_loop(engine: AsyncLLM) -> None:
    runner = engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device error")
        return real(sched)

    runner.execute = flaky
    try:
        async def main():
            with pytest.raises(RuntimeError, match="injected device error"):
                await collect(engine, [1, 2, 3], SamplingParams(max_tokens=4), "boom")
            return await collect(engine, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "after")

        outs = asyncio.run(main())
    finally:
        runner.execute = real
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert engine.is_running and engine.stats()["kv_blocks_used"] == 0


def test_stop_strings_stop_tokens_and_lengths(engine: AsyncLLM) -> None:
    prompt = [7, 8, 9, 10]
    base = asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                               "base"))[-1].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.find(stop)
    out = asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                             ignore_eos=True), "s1"))
    final = out[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop and final.text == text[:cut]
    assert all(final.text.startswith(o.outputs[0].text) for o in out)   # the pending stop string never showed
    out = asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                             include_stop_str_in_output=True, ignore_eos=True), "s2"))
    assert out[-1].outputs[0].text == text[:cut + len(stop)]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok],
                                                             ignore_eos=True), "s3"))[-1].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = asyncio.run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=first + 2,
                                                             stop_token_ids=[stop_tok], ignore_eos=True),
                              "s4"))[-1].outputs[0]
    assert stop_tok not in out.token_ids[:first + 2]     # min_tokens bans the stop token early


def test_streams_on_two_event_loops_at_once_each_get_theirs(engine: AsyncLLM) -> None:
    """A step's outputs are delivered per event loop in one batch: each loop gets exactly its streams."""
    import threading

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results: dict[str, list] = {}

    def run_loop(tag: str) -> None:
        async def main():
            return await asyncio.gather(*[collect(engine, [3 + i, 4, 5], params, f"{tag}{i}") for i in range(3)])
        results[tag] = asyncio.run(main())

    threads = [threading.Thread(target=run_loop, args=(t,)) for t in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for tag in ("x", "y"):
        for i, outs in enumerate(results[tag]):
            assert {o.request_id for o in outs} == {f"{tag}{i}"}
            assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 11))
            assert outs[-1].finished
