"""The throughput benchmark end to end on CPU with a tiny model, and the seeded workloads."""

import json
from pathlib import Path

import pytest

from kvfleet.engine.bench.stats import kv_fragmentation, percentiles, request_latencies
from kvfleet.engine.bench.throughput import main
from kvfleet.engine.bench.workloads import BenchRequest, chat_mix_workload, load_workload, random_workload, write_jsonl


def test_workloads_are_seeded_and_shaped_as_specified() -> None:
    chat = chat_mix_workload()
    assert len(chat) == 1000 and chat == chat_mix_workload()
    assert all(16 <= len(r.prompt_token_ids) <= 4096 and 8 <= r.max_tokens <= 1024 for r in chat)
    # total/output token ratio of the vLLM figures (22,819 / 8,473) follows from the lengths
    total = sum(len(r.prompt_token_ids) + r.max_tokens for r in chat)
    assert abs(total / sum(r.max_tokens for r in chat) - 22819 / 8473) < 1e-3
    rnd = random_workload(num=3)
    assert [len(r.prompt_token_ids) for r in rnd] == [1024] * 3 and {r.max_tokens for r in rnd} == {128}


def test_workload_file_round_trip_and_errors(tmp_path: Path) -> None:
    reqs = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    assert load_workload(str(tmp_path / "w.jsonl")) == reqs
    (tmp_path / "bad.jsonl").write_text('{"prompt_token_ids": [1], "max_tokens": 0}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        load_workload(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="workload"):
        load_workload("no-such-workload")


def test_stats_helpers() -> None:
    assert percentiles([]) is None
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p is not None and p["mean"] == 2.5 and p["p50"] == 2.5
    assert request_latencies(10.0, 10.5, 12.5, 5) == (0.5, 0.5)
    frag = kv_fragmentation(blocks_used=10, block_size=16, tokens_in_kv=150, num_seqs=4)
    assert frag["wasted_slots"] == 10 and frag["wasted_blocks_per_seq"] == 10 / 16 / 4


@pytest.mark.parametrize("backend", ["kvfleet", "hf"])
def test_throughput_cli_on_a_tiny_model(backend: str, tiny_model_factory, tmp_path: Path) -> None:
    model = tiny_model_factory("llama")
    reqs = [BenchRequest(list(range(3 + i, 20 + 2 * i)), 3 + i % 4) for i in range(6)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--workload", str(tmp_path / "w.jsonl"), "--backend", backend,
               "--out", str(out), "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32",
               "--hf-batch-size", "4", "--warmup-requests", "1", "--num-prompts", "5"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 5 and res["output_tokens"] == sum(r.max_tokens for r in reqs[:5])
    assert res["output_tokens_per_s"] == pytest.approx(res["output_tokens"] / res["wall_s"])
    assert res["environment"]["torch"]
    if backend == "kvfleet":
        assert res["requests_with_wrong_length"] == 0
        assert res["ttft_ms"]["p50"] > 0 and res["kv_peak"]["kv_blocks_used"] > 0
        assert res["kv_peak"]["wasted_blocks_per_seq"] < 1.0
        decode = res["step_breakdown_ms"]["decode"]
        assert decode["steps"] > 0 and decode["gc_ms"] >= 0 and decode["sampling_batch_ms"] > 0
        slowest = decode["slowest"]
        assert 0 < len(slowest) <= 5 and slowest[0]["step_ms"] >= slowest[-1]["step_ms"] > 0
        assert slowest[0]["batch"] >= 1 and slowest[0]["forward_ms"] > 0
        # on the CPU Triton's interpreter loads no kernel: none readied in the run (the count is for CUDA)
        assert res["triton_variants_in_run"] in (0, None) and "warmup_triton_compiles" in res
    else:
        assert res["batches"] == 2


def test_throughput_cli_repetition_penalty_launches_ahead(tiny_model_factory, tmp_path: Path, monkeypatch) -> None:
    # --repetition-penalty reaches every request and the file name says it; with async scheduling its steps are
    # launched ahead (the penalty takes the token in flight on the device), even with KVFLEET_FORWARD_AHEAD on,
    # which the JSON counts.
    monkeypatch.setattr("kvfleet.engine.llm_engine.FORWARD_AHEAD", True)
    model = tiny_model_factory("llama")
    reqs = [BenchRequest(list(range(3 + i, 20 + 2 * i)), 6) for i in range(4)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    rc = main(["--model", str(model), "--workloads", str(tmp_path / "w.jsonl"), "--out-dir", str(tmp_path / "out"),
               "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32", "--warmup-requests", "1",
               "--async-scheduling", "--repetition-penalty", "1.3"])
    assert rc == 0
    (path,) = (tmp_path / "out").glob("*.json")
    res = json.loads(path.read_text())
    assert path.name.endswith("-w-rp1.3.json") and res["repetition_penalty"] == 1.3
    assert res["steps_launched_ahead"] > 0 and res["steps_forwarded_ahead"] == 0
    assert res["requests_with_wrong_length"] == 0
    with pytest.raises(SystemExit) as exc:   # argparse's usage error
        main(["--model", str(model), "--workload", "chat-mix", "--repetition-penalty", "0"])
    assert exc.value.code == 2


@pytest.mark.parametrize("async_flag", ["--async-scheduling", "--no-async-scheduling"])
def test_throughput_cli_step_trace_counts_every_token_once(async_flag: str, tiny_model_factory,
                                                           tmp_path: Path) -> None:
    # --step-trace: every output token in exactly one step, each request one first token and one finish, and a
    # prefill phase that ends before the tail does (with async scheduling a call reads the step before's tokens).
    from kvfleet.engine.bench.step_trace import StepTrace, phase_summary

    model = tiny_model_factory("llama")
    reqs = [BenchRequest(list(range(3 + i, 20 + 3 * i)), 2 + 3 * i) for i in range(6)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    out = tmp_path / "r.json"
    rc = main(["--model", str(model), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out), "--dtype",
               "float32", "--device", "cpu", "--num-kv-blocks", "32", "--warmup-requests", "1", "--max-num-seqs", "4",
               async_flag, "--step-trace"])
    assert rc == 0
    res = json.loads(out.read_text())
    trace = StepTrace.from_json(res["step_trace"])
    assert sum(trace.tokens) == res["output_tokens"] == sum(r.max_tokens for r in reqs)
    assert len(trace.first_token_s) == len(trace.finished_s) == len(reqs)
    assert trace.t_s == sorted(trace.t_s) and 0 < trace.t_s[0] and trace.t_s[-1] <= res["wall_s"]
    s = phase_summary(trace)
    assert 0 < s.prefill_end_s < s.end_s and s.prefill_steps + s.tail_steps == s.steps
    assert max(trace.tokens) <= 4   # --max-num-seqs: no step gave more tokens than its batch


def test_throughput_cli_tensor_parallel_2_on_cpu_generates_the_same_tokens(tiny_model_factory, tmp_path: Path) -> None:
    # TP=2 (gloo, two processes) through the benchmark: same requests done, exact lengths, same greedy work.
    model = tiny_model_factory("llama")
    reqs = [BenchRequest(list(range(3 + i, 20 + 2 * i)), 3 + i % 4) for i in range(4)]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    results = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        rc = main(["--model", str(model), "--workload", str(tmp_path / "w.jsonl"), "--out", str(out),
                   "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "32", "--warmup-requests", "1",
                   "--tensor-parallel-size", str(tp)])
        assert rc == 0
        results[tp] = json.loads(out.read_text())
    for tp, res in results.items():
        assert res["tensor_parallel_size"] == tp and res["requests_with_wrong_length"] == 0
        assert res["output_tokens"] == sum(r.max_tokens for r in reqs)


def test_throughput_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--workload", "chat-mix", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["--model", str(tmp_path), "--workload", "chat-mix", "--backend", "hf",
                 "--tensor-parallel-size", "2", "--out", str(tmp_path / "x.json")]) == 2
    capsys.readouterr()
    assert main(["--model", str(tmp_path), "--workload", "chat-mix", "--backend", "hf", "--step-trace",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "error: step_trace: the hf baseline has no engine steps" in capsys.readouterr().err
