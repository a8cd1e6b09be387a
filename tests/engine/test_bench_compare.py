"""Issue 16's comparison pieces on CPU: the three workload classes, several workloads through one engine,
the vLLM arguments (dry: vLLM only runs on the GPU machine), the online stage against a real `kvfleet serve`,
and the summary table."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from kvfleet.engine.bench import compare, workloads
from kvfleet.engine.bench.throughput import main as throughput_main
from kvfleet.engine.bench.vllm_backend import llm_kwargs, sampling_kwargs
from kvfleet.engine.bench.workloads import BenchRequest, write_jsonl

# EngineArgs fields of vLLM 0.26.0 that the benchmark sets (read from the wheel's engine/arg_utils.py and
# entrypoints/llm.py; `bench/vllm_wheels.sh check` on the wheel is where they were looked up).
VLLM_0_26_ENGINE_ARGS = {"model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                         "gpu_memory_utilization", "enable_prefix_caching", "enforce_eager", "tensor_parallel_size",
                         "seed", "skip_tokenizer_init", "load_format", "quantization", "num_gpu_blocks_override",
                         "block_size"}
VLLM_0_26_SAMPLING_FIELDS = {"n", "temperature", "max_tokens", "ignore_eos", "detokenize", "repetition_penalty"}


def test_workload_classes_are_seeded_and_shaped() -> None:
    long = workloads.named_workload("long-prompt")
    assert len(long) == 96 and long == workloads.named_workload("long-prompt")
    assert all(4096 <= len(r.prompt_token_ids) < 8192 and r.max_tokens == 128 and r.n == 1 for r in long)
    shared = workloads.named_workload("shared-prefix")
    assert len(shared) == 512
    heads = {tuple(r.prompt_token_ids[:2048]) for r in shared}
    assert len(heads) == 8   # every prompt starts with one of 8 system prompts of 2048 tokens
    assert all(2048 + 128 <= len(r.prompt_token_ids) < 2048 + 512 for r in shared)
    par = workloads.named_workload("parallel-sampling")
    assert len(par) == 256 and all(r.n == 4 and r.temperature > 0 and len(r.prompt_token_ids) == 512 for r in par)
    assert workloads.summary(par)["output_tokens"] == 256 * 4 * 128
    # the published workloads did not change
    assert workloads.named_workload("random-1024-128") == workloads.random_workload()
    assert workloads.named_workload("chat-mix", seed=3) == workloads.chat_mix_workload(seed=3)
    with pytest.raises(ValueError, match="workload"):
        workloads.named_workload("nope")


def test_several_workloads_through_one_engine(tiny_model_factory, tmp_path: Path) -> None:
    model = tiny_model_factory("llama")
    greedy = [BenchRequest(list(range(3 + i, 20 + 2 * i)), 3 + i % 3) for i in range(4)]
    sampled = [BenchRequest(list(range(5, 30)), 4, n=3), BenchRequest(list(range(7, 12)), 2, n=2)]
    write_jsonl(greedy, tmp_path / "greedy.jsonl")
    write_jsonl(sampled, tmp_path / "sampled.jsonl")
    out = tmp_path / "res"
    rc = throughput_main(["--model", str(model), "--workloads", str(tmp_path / "greedy.jsonl"),
                          str(tmp_path / "sampled.jsonl"), "--out-dir", str(out), "--dtype", "float32",
                          "--device", "cpu", "--num-kv-blocks", "64", "--warmup-requests", "1"])
    assert rc == 0
    files = sorted(p.name for p in out.glob("*.json"))
    assert files == [f"kvfleet-{model.name}-greedy.json", f"kvfleet-{model.name}-sampled.json"]
    g = json.loads((out / files[0]).read_text())
    s = json.loads((out / files[1]).read_text())
    assert g["output_tokens"] == sum(r.max_tokens for r in greedy) and g["requests_with_wrong_length"] == 0
    assert s["output_tokens"] == 3 * 4 + 2 * 2 and s["requests_with_wrong_length"] == 0
    assert s["workload_summary"]["samples_per_request"] == 2.5
    # one engine: started once, so both runs report the same start time
    assert g["init_s"] == s["init_s"] and g["max_model_len"] == s["max_model_len"]


def test_throughput_argument_errors(tmp_path: Path, tiny_model_factory) -> None:
    model = str(tiny_model_factory("llama"))
    assert throughput_main(["--model", model, "--workloads", "chat-mix"]) == 2              # no --out-dir
    assert throughput_main(["--model", model, "--workload", "chat-mix"]) == 2               # no --out
    assert throughput_main(["--model", model, "--workload", "chat-mix", "--workloads", "chat-mix",
                            "--out", str(tmp_path / "x.json")]) == 2
    assert throughput_main(["--model", model, "--workload", "chat-mix", "--backend", "hf", "--quantization", "fp8",
                            "--out", str(tmp_path / "x.json")]) == 2


def test_vllm_arguments_are_vllm_0_26_names(tmp_path: Path) -> None:
    from kvfleet.engine.bench.throughput import build_parser

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = build_parser().parse_args(["--model", str(model), "--workloads", "chat-mix", "--out-dir", "x",
                                      "--backend", "vllm", "--load-format", "dummy", "--quantization", "fp8",
                                      "--block-size", "64"])
    kw = llm_kwargs(args, 8448)
    assert set(kw) <= VLLM_0_26_ENGINE_ARGS
    assert kw["skip_tokenizer_init"] is True and kw["load_format"] == "dummy" and kw["quantization"] == "fp8"
    assert kw["block_size"] == 64
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["gpu_memory_utilization"]) == (1024, 16384, 0.9)
    assert kw["max_model_len"] == 8448 and kw["enable_prefix_caching"] is True
    (model / "tokenizer.json").write_text("{}")
    assert llm_kwargs(args, 100)["skip_tokenizer_init"] is False
    sk = sampling_kwargs(BenchRequest([1, 2], 5, n=4))
    assert set(sk) <= VLLM_0_26_SAMPLING_FIELDS and sk["n"] == 4 and sk["temperature"] > 0
    assert sampling_kwargs(BenchRequest([1], 3))["temperature"] == 0.0   # greedy, as kvfleet's side


def test_parse_loads_and_server_commands() -> None:
    pts = compare.parse_loads(compare.DEFAULT_LOADS)
    assert [(p.name, p.rate, p.num_prompts, p.seed) for p in pts] == [
        ("low", 0.5, 16, 1), ("r4", 4.0, 120, 2), ("r12", 12.0, 240, 3), ("burst", float("inf"), 300, 4)]
    for bad in ("x:0:3", "x:1", "x:1:0", ""):
        with pytest.raises(ValueError, match="loads"):
            compare.parse_loads(bad)
    from kvfleet.engine.cli import build_parser

    cmd = compare.server_command("kvfleet", "bench/models/llama-3.1-8b", 8123, 4096, 1024, 8192, 0.9, "fp8",
                                 block_size=64)
    assert cmd[1:4] == ["-m", "kvfleet.engine.cli", "serve"]
    ns = build_parser().parse_args(cmd[3:])   # every flag is one `kvfleet serve` knows
    assert (ns.max_num_seqs, ns.max_num_batched_tokens, ns.max_model_len, ns.quantization) == (1024, 8192, 4096, "fp8")
    assert ns.block_size == 64
    vcmd = compare.server_command("vllm", "bench/models/llama-3.1-8b", 8123, 4096, 1024, 8192, 0.9, None)
    assert vcmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and "--skip-tokenizer-init" in vcmd
    assert vcmd[vcmd.index("--max-num-batched-tokens") + 1] == "8192"


def _offline(backend: str, workload: str, tok_s: float, quant: str | None = None, label: str | None = None) -> dict:
    return {"backend": backend, "model": "llama-3.1-8b", "workload": workload, "quantization": quant, "label": label,
            "output_tokens_per_s": tok_s, "requests_with_wrong_length": 0}


def test_summary_table(tmp_path: Path) -> None:
    recs = {
        "a.json": _offline("kvfleet", "chat-mix", 9000.0), "b.json": _offline("vllm", "chat-mix", 8000.0),
        "c.json": _offline("kvfleet", "long-prompt", 800.0, label="prefill-128-64-8-3"),
        "d.json": _offline("vllm", "long-prompt", 1000.0),
        "e.json": _offline("kvfleet", "chat-mix", 12000.0, quant="fp8"),
        "f.json": {"engine": "kvfleet", "model_dir": "llama-3.1-8b", "quantization": None, "label": None,
                   "load_point": "low", "ttft_ms": {"p50": 50.0, "p99": 100.0}, "tpot_ms": {"p50": 5.0},
                   "e2el_ms": {"p50": 600.0}, "failed": 0},
        "g.json": {"engine": "vllm", "model_dir": "llama-3.1-8b", "quantization": None, "label": None,
                   "load_point": "low", "ttft_ms": {"p50": 40.0, "p99": 120.0}, "tpot_ms": {"p50": 5.5},
                   "e2el_ms": {"p50": 660.0}, "failed": 0},
        "h.json": {"engine": "kvfleet", "model": "llama-3.1-8b", "time_to_healthy_s": 21.5},
        "i.json": {"engine": "vllm", "model": "llama-3.1-8b", "time_to_healthy_s": None, "error": "not healthy"},
        "junk.json": [1, 2],
    }
    for name, rec in recs.items():
        (tmp_path / name).write_text(json.dumps(rec))
    text = "\n".join(compare.summary_lines(*compare.load_results([tmp_path])))
    assert "| llama-3.1-8b chat-mix, output tok/s | 9,000 | 8,000 | 1.12 |" in text
    assert "| llama-3.1-8b long-prompt [prefill-128-64-8-3], output tok/s | 800 | 1,000 | 0.80 |" in text
    assert "| llama-3.1-8b chat-mix fp8, output tok/s | 12,000 | - | - |" in text
    assert ("| llama-3.1-8b low | 50.0 / 40.0 | 100.0 / 120.0 | 5.0 / 5.5 | 600.0 / 660.0 | 0.80, 1.20, 1.10, 1.10 "
            "| 0 / 0 |") in text
    assert "| kvfleet llama-3.1-8b | 21.5 |" in text and "| vllm llama-3.1-8b | not healthy |" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_online_stage_against_kvfleet_serve(tiny_model_factory, tmp_path: Path) -> None:
    model = tiny_model_factory("llama")
    write_jsonl([BenchRequest([5 + i, 6, 7, 8, 9], 4) for i in range(6)], tmp_path / "w.jsonl")
    out = tmp_path / "res"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = compare.run_online("kvfleet", str(model), out, compare.parse_loads("burst:inf:6,slow:20:3"),
                             _free_port(), 128, 16, 256, 0.9, None, None, 180.0,
                             workload=str(tmp_path / "w.jsonl"), dtype="float32")
    assert res["time_to_healthy_s"] is not None and res["time_to_healthy_s"] > 0
    assert res["exit_code"] is not None   # the server is gone
    burst = json.loads((out / f"kvfleet-{model.name}-online-burst.json").read_text())
    slow = json.loads((out / f"kvfleet-{model.name}-online-slow.json").read_text())
    assert burst["completed"] == 6 and burst["failed"] == 0 and burst["total_output_tokens"] == 24
    assert slow["completed"] == 3 and slow["request_rate"] == 20.0
    assert burst["ttft_ms"]["p50"] > 0 and burst["load_point"] == "burst"
    startup = json.loads((out / f"kvfleet-{model.name}-startup.json").read_text())
    assert startup["time_to_healthy_s"] == res["time_to_healthy_s"]
    # the server's histograms seen between two scrapes: its TTFT is within the client's
    sm = burst["server_means_ms"]
    assert 0 < sm["time_to_first_token_seconds"] <= burst["ttft_ms"]["mean"] + 1.0
    assert "request_queue_time_seconds" in sm and "inter_token_latency_seconds" in sm
    lines = compare.summary_lines(*compare.load_results([out]))
    assert any(line.startswith(f"| {model.name} burst |") for line in lines)
    assert any(line.startswith("| burst | kvfleet |") for line in lines)


def test_histogram_means() -> None:
    before = {"time_to_first_token_seconds": (1.0, 10.0)}
    after = {"time_to_first_token_seconds": (3.0, 20.0), "other_seconds": (0.5, 0.0)}
    assert compare.histogram_means_ms(before, after) == {"time_to_first_token_seconds": 200.0}
