"""Host (Python) cost of one engine step, measured on the CPU, without the forward.

The H200 runs (bench/NOTES.md) showed the engine bound by host Python at large
batches. This drives a real `LLMEngine` (scheduler, KV manager, model runner input
preparation, sampler, outputs) with a tiny Qwen3 config and dummy weights, and
replaces only the model's forward by random hidden states (seeded), so what is timed is
the host work a GPU step pays on top of its kernels:

- schedule: `Scheduler.schedule()`
- prepare: `ModelRunner.execute()` minus forward, LM head and sampler (flat inputs,
  attention metadata, sampling batch, collecting the sampled tokens)
- update: `Scheduler.update_from_output()`
- outputs: the rest of `LLMEngine.step()` (per-request bookkeeping, `RequestOutput`s)

LM head and sampler are device work on a GPU; here they run on the CPU and are
reported apart, outside the host total. Times are this thread's CPU time (the machine is
shared; wall time would include other processes), median over the timed steps.

Scenarios per batch B (default 256 and 1024): B sequences with 1000-token prompts,
prefilled, then decode steps at contexts ~1000-1100 tokens, timed with streaming
outputs (`step()`, what AsyncLLM uses) and with final outputs only (`step(final_only=True)`,
what `LLM.generate` uses); then mixed steps: 8 new 1024-token prompts join the B decodes
(chunked prefill within an 8192-token budget).

    .venv/bin/python bench/host_overhead.py --label baseline   # -> bench/results/host/baseline.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.testing import build_tokenizer, tiny_config

logger = logging.getLogger("host_overhead")
PARTS = ("schedule", "prepare", "update", "outputs")
PROMPT_LEN = 1000
MIXED_PROMPT_LEN = 1024
MIXED_NEW = 8
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
# This thread's CPU time: the machine is shared, so wall time would count other processes'
# turns on the cores. torch runs single-threaded here, so the thread's CPU time is the step's.
CLOCK: Callable[[], float] = time.thread_time


def write_model_dir(root: Path) -> Path:
    """Config + the tiny byte-level BPE tokenizer (dummy weights): outputs are detokenized as in serving."""
    tok = build_tokenizer(512)
    cfg = tiny_config("qwen3", vocab_size=len(tok), num_layers=1, max_position_embeddings=MAX_MODEL_LEN,
                      num_kv_heads=1)
    cfg.save_pretrained(root)
    tok.save_pretrained(root)
    return root


class StepParts:
    """Timers around the engine's step parts; the forward becomes random hidden states (not host time)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.cur: dict[str, float] = {}
        sched, runner = engine.scheduler, engine.runner
        hidden = runner.model_config.hf_config.hidden_size

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*a: Any, **kw: Any) -> Any:
                t = CLOCK()
                try:
                    return fn(*a, **kw)
                finally:
                    self.cur[name] = self.cur.get(name, 0.0) + CLOCK() - t
            return wrapper

        gen = torch.Generator().manual_seed(0)

        def fake_forward(input_ids: torch.Tensor, *rest: Any, **options: Any) -> torch.Tensor:
            # Random hidden states: varied tokens (so detokenization does real work), repeatable.
            return torch.randn(input_ids.shape[0], hidden, generator=gen, dtype=runner.dtype)

        orig_schedule = timed("schedule", sched.schedule)

        def schedule() -> Any:
            out = orig_schedule()
            self.batch = len(out.scheduled)
            return out

        self.batch = 0
        sched.schedule = schedule  # type: ignore[method-assign]
        sched.update_from_output = timed("update", sched.update_from_output)  # type: ignore[method-assign]
        runner.execute = timed("execute", runner.execute)  # type: ignore[method-assign]
        executor = runner.executor
        executor.forward = timed("forward", fake_forward)  # type: ignore[method-assign]
        executor.compute_logits = timed("logits", executor.compute_logits)  # type: ignore[method-assign]
        sampler = runner.sampler
        runner.sampler = timed("sample", sampler.__call__)  # type: ignore[assignment]

    def step(self, engine: LLMEngine, final_only: bool) -> tuple[dict[str, float], list[Any]]:
        self.cur = {}
        t = CLOCK()
        outs = engine.step(final_only=final_only)
        total = CLOCK() - t
        c = self.cur
        device = c.get("forward", 0.0) + c.get("logits", 0.0) + c.get("sample", 0.0)
        parts = {"schedule": c.get("schedule", 0.0),
                 "prepare": c.get("execute", 0.0) - device,
                 "update": c.get("update", 0.0),
                 "outputs": total - c.get("schedule", 0.0) - c.get("execute", 0.0) - c.get("update", 0.0),
                 "device_on_cpu": device}
        return parts, outs


def summarize(samples: list[dict[str, float]], batches: list[int]) -> dict[str, Any]:
    """Median and mean milliseconds per part, host total, and µs per sequence (median step)."""
    out: dict[str, Any] = {"steps": len(samples), "mean_batch": statistics.fmean(batches)}
    host = [sum(s[p] for p in PARTS) for s in samples]
    for p in (*PARTS, "device_on_cpu"):
        vals = [s[p] for s in samples]
        out[f"{p}_ms"] = 1e3 * statistics.median(vals)
        out[f"{p}_ms_mean"] = 1e3 * statistics.fmean(vals)
    out["host_ms"] = 1e3 * statistics.median(host)
    out["host_ms_mean"] = 1e3 * statistics.fmean(host)
    out["host_ms_min"] = 1e3 * min(host)
    out["host_ms_max"] = 1e3 * max(host)
    out["host_ms_p25"] = 1e3 * float(np.percentile(host, 25))
    out["host_us_per_seq"] = 1e3 * out["host_ms"] / out["mean_batch"]
    return out


def params(max_tokens: int, repetition_penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          repetition_penalty=repetition_penalty)


def run_batch(model_dir: Path, batch: int, steps: int, budget: int, rng: np.random.Generator,
              repetition_penalty: float = 1.0) -> dict[str, Any]:
    # Sequences decode while later ones still prefill: room for that, both timed modes and the mixed rounds.
    prefill_steps = -(-batch * PROMPT_LEN // max(1, budget - batch))
    max_tokens = prefill_steps + 2 * (steps + 3) + 64
    blocks = (batch + MIXED_NEW) * -(-(PROMPT_LEN + max_tokens + MIXED_PROMPT_LEN) // BLOCK_SIZE)
    cfg = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", load_format="dummy",
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=batch + MIXED_NEW, max_num_batched_tokens=budget,
                       num_kv_blocks=blocks, block_size=BLOCK_SIZE)
    engine = LLMEngine(cfg)
    parts = StepParts(engine)
    for i in range(batch):
        engine.add_request(f"d{i}", rng.integers(3, 500, PROMPT_LEN).tolist(),
                           params(max_tokens, repetition_penalty))
    while any(not r.is_prefill_done for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    res: dict[str, Any] = {"batch": batch, "prompt_len": PROMPT_LEN, "token_budget": budget, "kv_blocks": blocks,
                           "repetition_penalty": repetition_penalty}
    for mode, final_only in (("decode_stream", False), ("decode_final", True)):
        for _ in range(3):   # warm-up
            parts.step(engine, final_only)
        samples, batches = [], []
        for _ in range(steps):
            p, _ = parts.step(engine, final_only)
            samples.append(p)
            batches.append(parts.batch)
        res[mode] = summarize(samples, batches)
        res[mode]["context_len"] = engine.scheduler.running[0].num_tokens
    samples, batches = [], []
    for r in range(3):
        for j in range(MIXED_NEW):
            engine.add_request(f"m{r}_{j}", rng.integers(3, 500, MIXED_PROMPT_LEN).tolist(),
                               params(1, repetition_penalty))
        while any(rid.startswith("m") for rid in engine.groups):
            p, _ = parts.step(engine, False)
            samples.append(p)
            batches.append(parts.batch)
    res["mixed_stream"] = summarize(samples, batches)
    engine.shutdown()
    return res


def git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "engine/kvfleet/engine"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    import kvfleet.engine

    # engine_path: which engine ran (a baseline re-run points PYTHONPATH at an exported old tree)
    return {"commit": sha, "engine_dirty": bool(dirty), "engine_path": str(Path(kvfleet.engine.__file__).parent)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="result name: bench/results/host/<label>.json")
    ap.add_argument("--batches", default="256,1024", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="on every request: the sampler's penalty inputs are built each step")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "host"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {"label": args.label, **git_commit(), "python": sys.version.split()[0],
                              "torch": torch.__version__, "clock": "time.thread_time",
                              "machine": platform.processor() or platform.machine(),
                              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp))
        for b in (int(x) for x in args.batches.split(",")):
            gc.collect()
            run = run_batch(model_dir, b, args.steps, args.budget, rng, args.repetition_penalty)
            result["runs"].append(run)
            for mode in ("decode_stream", "decode_final", "mixed_stream"):
                m = run[mode]
                if m["steps"] and abs(m["mean_batch"] - b) > MIXED_NEW:
                    raise RuntimeError(f"{mode}: mean batch {m['mean_batch']:.1f}, expected ~{b}")
                logger.info("B=%-5d %-13s host %6.2f ms (min %6.2f, mean %6.2f, max %6.2f; %5.1f us/seq): %s", b,
                            mode, m["host_ms"], m["host_ms_min"], m["host_ms_mean"], m["host_ms_max"],
                            m["host_us_per_seq"], "  ".join(f"{p} {m[p + '_ms']:.2f}" for p in PARTS))
    out = Path(args.out_dir) / f"{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
