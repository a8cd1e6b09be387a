"""Offline throughput benchmark: ``kvfleet bench throughput``.

Runs a seeded workload (``bench/workloads``) through the kvfleet engine or, as the
naive baseline it replaces, transformers' ``generate`` in static left-padded
batches, and writes one JSON of throughput, latency percentiles, memory and KV
statistics. Every request is greedy with ``ignore_eos``; a few warm-up requests
run before the clock starts; the time is the wall time of the whole workload.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvfleet.engine.bench.workloads import BenchRequest, load_workload, summary

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfleet bench throughput", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model folder (config.json; weights unless --load-format dummy)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    ap.add_argument("--workload", required=True, help="random-1024-128, chat-mix, or a JSONL file")
    ap.add_argument("--backend", default="kvfleet", choices=["kvfleet", "hf"])
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N requests")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    # vLLM's defaults for its LLM class on GPUs of >= 70 GiB (H100/H200), so the comparison is like for like
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
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--warmup-requests", type=int, default=4)
    ap.add_argument("--label", default=None, help="free text stored in the JSON")
    ap.add_argument("--decode-probe", default=None, metavar="BxCTX",
                    help="after the run, time one decode step at batch B and context CTX (CUDA), e.g. 256x1024")
    return ap


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("num_prompts: must be >= 1")
    if args.tensor_parallel_size < 1:
        raise ValueError("tensor_parallel_size: must be >= 1")
    if args.tensor_parallel_size != 1 and args.backend == "hf":
        raise ValueError("tensor_parallel_size: the hf baseline runs on one device only")
    if args.hf_batch_size < 1:
        raise ValueError("hf_batch_size: must be >= 1")
    if not Path(args.model, "config.json").is_file() and not str(args.model).endswith(".gguf"):
        raise ValueError(f"model: {args.model!r} has no config.json")


def git_commit() -> str | None:
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check_args(args)
    reqs = load_workload(args.workload)
    if args.num_prompts is not None:
        reqs = reqs[: args.num_prompts]
    if args.backend == "kvfleet":
        from kvfleet.engine.bench.kvfleet_backend import run_kvfleet

        result = run_kvfleet(args, reqs, warmup_requests(args.warmup_requests))
    else:
        from kvfleet.engine.bench.hf_backend import run_hf

        result = run_hf(args, reqs, warmup_requests(args.warmup_requests))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    output_tokens = sum(r.max_tokens for r in reqs)
    wall = result["wall_s"]
    out = {
        "backend": args.backend, "model": Path(args.model).name, "workload": Path(args.workload).stem,
        "label": args.label, "num_requests": len(reqs), "workload_summary": summary(reqs),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "requests_per_s": len(reqs) / wall, "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        **result, "environment": environment(),
        "args": {k: v for k, v in vars(args).items()},
    }
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        out = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"{out['backend']} {out['model']} {out['workload']}: {out['num_requests']} req in {out['wall_s']:.1f}s, "
          f"{out['requests_per_s']:.2f} req/s, {out['output_tokens_per_s']:.0f} out tok/s, "
          f"{out['total_tokens_per_s']:.0f} total tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
