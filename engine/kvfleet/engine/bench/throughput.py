"""Offline throughput benchmark: ``kvfleet bench throughput``.

Runs seeded workloads (``bench/workloads``) through the kvfleet engine, vLLM (``--backend vllm``,
on the GPU machine where it is installed: ``bench/compare_vllm.sh``) or, as the naive baseline,
transformers' ``generate`` in static left-padded batches, and writes one JSON per workload of
throughput, latency percentiles, memory and KV statistics. Every request has ``ignore_eos`` and
is greedy unless it asks for ``n > 1`` samples; a few warm-up requests run before the clock
starts; the time is the wall time of the whole workload. With ``--workloads A B ...`` one engine
(started once) runs each in turn, its prefix cache emptied between them, one JSON each in
``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvfleet.engine.bench.workloads import NAMES, BenchRequest, load_workload, summary

logger = logging.getLogger(__name__)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfleet bench throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model folder (config.json; weights unless --load-format dummy)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    ap.add_argument("--workload", default=None, help=f"one of {', '.join(NAMES)}, or a JSONL file")
    ap.add_argument("--workloads", nargs="+", default=None, metavar="WORKLOAD",
                    help="several workloads through one engine (with --out-dir)")
    ap.add_argument("--backend", default="kvfleet", choices=["kvfleet", "hf", "vllm"])
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--out", default=None, help="JSON file to write (one workload)")
    ap.add_argument("--out-dir", default=None, help="folder for BACKEND-MODEL-WORKLOAD[-LABEL].json (--workloads)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="fp8: weights quantized to FP8 at load, per-token activation scales (CUDA, sm >= 8.9)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    # vLLM's defaults for its LLM class on GPUs of >= 70 GiB (H100/H200), so the comparison is like for like
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV cache block size in tokens (default: the engine's own, 16 for both)")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the workload's longest request")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool (CPU runs)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="kvfleet: schedule and process outputs beside the device's step (kvfleet.engine.async_step;"
                         " default: on for CUDA)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--profile-host", default=None, metavar="FILE",
                    help="kvfleet: cProfile the timed run, top functions to FILE (slows the run)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="kvfleet on CUDA: count the Python stacks of calls that make the host wait for the device "
                         "(torch.cuda.set_sync_debug_mode; slows the run: not for reported figures)")
    ap.add_argument("--step-trace", action="store_true",
                    help="kvfleet and vLLM: each step's time and tokens and each request's first and last token "
                         "times into the JSON (step_trace; bench/offline_phases.py compares two runs' phases)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--label", default=None, help="free text stored in the JSON")
    ap.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                    help="every request's repetition_penalty (1.0: none); a penalty makes the sampler read the "
                         "tokens of the step before (kvfleet: KVFLEET_FORWARD_AHEAD)")
    ap.add_argument("--decode-probe", default=None, metavar="BxCTX",
                    help="after the run, time one decode step at batch B and context CTX (CUDA), e.g. 256x1024")
    return ap


def _check_args(args: argparse.Namespace) -> None:
    if (args.workload is None) == (args.workloads is None):
        raise ValueError("workload: give --workload (with --out) or --workloads (with --out-dir)")
    if args.workload is not None and not args.out:
        raise ValueError("out: --workload needs --out FILE")
    if args.workloads is not None and not args.out_dir:
        raise ValueError("out_dir: --workloads needs --out-dir DIR")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("num_prompts: must be >= 1")
    if args.tensor_parallel_size < 1:
        raise ValueError("tensor_parallel_size: must be >= 1")
    if args.tensor_parallel_size != 1 and args.backend == "hf":
        raise ValueError("tensor_parallel_size: the hf baseline runs on one device only")
    if args.quantization and args.backend == "hf":
        raise ValueError("quantization: the hf baseline runs unquantized")
    if args.step_trace and args.backend == "hf":
        raise ValueError("step_trace: the hf baseline has no engine steps to trace (kvfleet and vllm only)")
    if args.hf_batch_size < 1:
        raise ValueError("hf_batch_size: must be >= 1")
    if not Path(args.model, "config.json").is_file() and not str(args.model).endswith(".gguf"):
        raise ValueError(f"model: {args.model!r} has no config.json")


def git_commit() -> str | None:
    """The commit measured: KVFLEET_COMMIT when the caller names it (a tree copied to the GPU machine may carry a
    `.git` whose HEAD is not the commit of the files that travelled), else git, else bench/.commit."""
    named = os.environ.get("KVFLEET_COMMIT", "").strip()
    if named:
        return named
    here = Path(__file__).resolve()
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here.parent, capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for parent in here.parents:  # a copy of the tree without .git: bench/.commit, written by gpu_run
        f = parent / "bench" / ".commit"
        if f.is_file():
            return f.read_text().strip()
    return None


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "git_commit": git_commit()}
    for mod in ("triton", "transformers", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def warmup_requests(n: int, vocab_high: int = 100) -> list[BenchRequest]:
    """Short requests of their own tokens, so they seed nothing the timed run could hit in the prefix cache."""
    import numpy as np

    rng = np.random.default_rng(12345)
    return [BenchRequest(rng.integers(0, vocab_high, size=64).tolist(), 8) for _ in range(n)]


class _HfBench:
    """The hf baseline loads its model per workload (it is only ever run on one)."""

    def __init__(self, args: argparse.Namespace, max_model_len: int, warm: list[BenchRequest]) -> None:
        self.args, self.warm = args, warm

    def run(self, reqs: list[BenchRequest]) -> dict[str, Any]:
        from kvfleet.engine.bench.hf_backend import run_hf

        if any(r.n != 1 for r in reqs):
            raise ValueError("workload: the hf baseline samples one sequence per prompt (n > 1 requested)")
        return run_hf(self.args, reqs, self.warm)

    def close(self) -> None:
        pass


def open_backend(args: argparse.Namespace, max_model_len: int, warm: list[BenchRequest]) -> Any:
    """An object with run(reqs) -> dict and close()."""
    if args.backend == "kvfleet":
        from kvfleet.engine.bench.kvfleet_backend import KvfleetBench

        return KvfleetBench(args, max_model_len, warm)
    if args.backend == "vllm":
        from kvfleet.engine.bench.vllm_backend import VllmBench

        return VllmBench(args, max_model_len, warm)
    return _HfBench(args, max_model_len, warm)


def workload_requests(args: argparse.Namespace) -> dict[str, list[BenchRequest]]:
    names = args.workloads if args.workloads is not None else [args.workload]
    out = {}
    for name in names:
        reqs = load_workload(name)
        if args.repetition_penalty != 1.0:
            reqs = [dataclasses.replace(r, repetition_penalty=args.repetition_penalty) for r in reqs]
        out[Path(name).stem if name.endswith(".jsonl") else name] = reqs[: args.num_prompts] if args.num_prompts \
            else reqs
    return out


def record(args: argparse.Namespace, workload: str, reqs: list[BenchRequest], result: dict[str, Any]
           ) -> dict[str, Any]:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    output_tokens = sum(r.output_tokens for r in reqs)
    wall = result["wall_s"]
    return {
        "backend": args.backend, "model": Path(args.model).name, "workload": workload,
        "label": args.label, "quantization": args.quantization, "num_requests": len(reqs),
        "repetition_penalty": args.repetition_penalty,
        "workload_summary": summary(reqs), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "requests_per_s": len(reqs) / wall, "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        **result, "environment": environment(),
        "args": {k: v for k, v in vars(args).items()},
    }


def write_record(args: argparse.Namespace, rec: dict[str, Any]) -> Path:
    path = Path(args.out) if args.out else Path(args.out_dir) / out_name(rec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    return path


def run_all(args: argparse.Namespace, write: bool = False) -> list[dict[str, Any]]:
    """Every workload through one engine; one record each (each written as soon as it is done if `write`:
    a later workload that fails or runs out of time loses only itself)."""
    _check_args(args)
    workloads = workload_requests(args)
    everything = [r for reqs in workloads.values() for r in reqs]
    from kvfleet.engine.bench.kvfleet_backend import default_max_model_len

    max_len = args.max_model_len or default_max_model_len(everything)
    backend = open_backend(args, max_len, warmup_requests(args.warmup_requests))
    records = []
    try:
        for name, reqs in workloads.items():
            records.append(record(args, name, reqs, backend.run(reqs)))
            _print_line(records[-1])
            if write:
                write_record(args, records[-1])
    finally:
        backend.close()
    return records


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One workload (``--workload``)."""
    return run_all(args)[0]


def out_name(rec: dict[str, Any]) -> str:
    quant = f"-{rec['quantization']}" if rec.get("quantization") else ""
    label = f"-{rec['label']}" if rec.get("label") else ""
    penalty = f"-rp{rec['repetition_penalty']:g}" if rec.get("repetition_penalty", 1.0) != 1.0 else ""
    return f"{rec['backend']}-{rec['model']}-{rec['workload']}{quant}{penalty}{label}.json"


def _print_line(out: dict[str, Any]) -> None:
    print(f"{out['backend']} {out['model']} {out['workload']}: {out['num_requests']} req in {out['wall_s']:.1f}s, "
          f"{out['requests_per_s']:.2f} req/s, {out['output_tokens_per_s']:.0f} out tok/s, "
          f"{out['total_tokens_per_s']:.0f} total tok/s", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_all(args, write=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
