"""The Gluon prefill kernels inside the engine's attention op (``KVFLEET_PREFILL_KERNEL=gluon`` and
``gluon-chunks``), on a Hopper GPU. Usage:
    python bench/gpu_gluon_engine_check.py OUT_DIR [MODEL_DIR]      (no dry run: Gluon has no CPU interpreter)

1. The op (must pass; exit status 1 if not): steps shaped like the offline long-prompt and shared-prefix workloads',
   Llama-3.1-8B's attention (32 query heads, 8 KV heads, D 128), bf16, q/k/v views of one fused projection, rotary
   fused with the cache write, a paged cache of 16-token blocks. Each step through `triton_paged_attention` with each
   Gluon choice and with v2, against the torch op in float32 on the same inputs: the relative error of each, whether
   the plan gave the Gluon kernel exactly the fresh prompts of `GLUON_MIN_QUERY_TOKENS` and more and its paged form
   exactly the chunks `long_prefix_chunks` picks, and the op's time per layer each way (the step's metadata and plan
   made once, as the engine's first layer does; then rotary, cache write and the kernels). A hung kernel (a wrong
   mbarrier phase waits for good) ends the check with status 3 after `GLUON_CHECK_ROW_TIMEOUT_S` (40 s) a row, the
   rows that ran and the hung one written.
2. The engine (reported, not required): MODEL_DIR (default bench/models/qwen3-0.6b, dummy weights, bf16) greedy on
   long prompts with each choice, in steps of at most 4,096 tokens (so that prompts are split into chunks over a
   cached prefix), one process each (the choice is read at import); how many of the sampled tokens agree with v2's
   (random weights give near ties, where bf16 rounding may pick another token).

Writes OUT_DIR/gluon_engine_check.json and prints a summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_gluon_attention_check import Watchdog  # noqa: E402

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention, triton_backend  # noqa: E402
from kvfleet.engine.attention.fresh_prompts import fresh_long_prompts, long_prefix_chunks  # noqa: E402
from kvfleet.engine.bench.decode_probe import median_cuda_ms  # noqa: E402
from kvfleet.engine.models.layers import RotaryEmbedding  # noqa: E402
from kvfleet.engine.rope import Rotary  # noqa: E402

from provenance import git_describe  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
BF16 = torch.bfloat16
SCALE = D ** -0.5
TOL = 1.5e-2   # bf16 against float32, as the kernel tests
# (name, query lengths, sequence lengths): a fresh prompt beside a chunk over a cached prefix and decode rows, as the
# long-prompt workload's 8,192-token steps; fresh prompts only; a fresh prompt under the threshold (v2's)
STEPS: list[tuple[str, list[int], list[int]]] = [
    ("fresh 5000 + chunk 3000 over 2500 + 8 decodes", [5000, 3000] + [1] * 8, [5000, 5500] + [700] * 8),
    ("fresh 4096 x 2", [4096, 4096], [4096, 4096]),
    ("fresh 6000 + fresh 1500 + fresh 600", [6000, 1500, 600], [6000, 1500, 600]),
    ("chunk 2048 over 6144 cached", [2048], [8192]),
    ("chunk 1000 over 5000 + chunk 100 over 7000", [1000, 100], [6000, 7100]),
    ("16 x 384 over 2048 cached (shared prefix)", [384] * 16, [2432] * 16),
]
CHOICES = ("gluon", "gluon-chunks")
ENGINE_PROMPTS = [2500, 4100, 6000, 3000]
ENGINE_TOKENS = 16
ENGINE_STEP_TOKENS = 4096


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def build_step(q_lens: list[int], seq_lens: list[int], gen: torch.Generator) -> dict[str, Any]:
    blocks = [-(-s // BLOCK) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 4, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks:
        tables.append(perm[i:i + n])
        i += n
    t = sum(q_lens)
    qkv = torch.randn(t, HQ + 2 * HKV, D, generator=gen).to(BF16)
    cache = torch.randn(2, len(perm), BLOCK, HKV, D, generator=gen).to(BF16)
    positions = torch.tensor([p for ql, s in zip(q_lens, seq_lens, strict=True) for p in range(s - ql, s)])
    cos, sin = RotaryEmbedding(D, 500000.0)(positions, torch.float32)
    return {"qkv": qkv.cuda(), "cache": cache.cuda(), "cos": cos.cuda(), "sin": sin.cuda(),
            "q_lens": q_lens, "seq_lens": seq_lens, "tables": tables}


def run_op(step: dict[str, Any], choice: str) -> tuple[torch.Tensor, triton_backend.PrefillPlan, float]:
    """The op with a prefill kernel choice -> (out on fresh copies of the step's tensors, its plan, median ms of the
    op per layer: the metadata and plan made once, as the engine's first layer makes them for the others, on one set
    of tensors that each call rotates again)."""
    triton_backend.PREFILL_KERNEL = choice
    rotary = Rotary(step["cos"], step["sin"])

    def call(qkv: torch.Tensor, cache: torch.Tensor, md: Any) -> torch.Tensor:
        q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
        return triton_backend.triton_paged_attention(q, k, v, cache, md, SCALE, rotary=rotary)

    def metadata() -> Any:
        return build_attention_metadata(step["q_lens"], step["seq_lens"], step["tables"], BLOCK, device="cuda")

    md = metadata()
    out = call(step["qkv"].clone(), step["cache"].clone(), md)
    plan = md.plans["triton_prefill"]
    qkv, cache, md = step["qkv"].clone(), step["cache"].clone(), metadata()
    ms = median_cuda_ms(lambda: call(qkv, cache, md), iters=10)
    assert isinstance(plan, triton_backend.PrefillPlan)
    return out, plan, ms


def reference(step: dict[str, Any]) -> torch.Tensor:
    qkv, cache = step["qkv"].float(), step["cache"].float()
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    md = build_attention_metadata(step["q_lens"], step["seq_lens"], step["tables"], BLOCK, device="cuda")
    return torch_paged_attention(q.clone(), k.clone(), v.clone(), cache, md, SCALE,
                                 rotary=Rotary(step["cos"], step["sin"]))


def _sequences(work: torch.Tensor | None) -> list[int]:
    return sorted(set(work[:, 0].tolist())) if work is not None else []


def op_rows(rows: list[dict[str, Any]], watchdog: Watchdog) -> bool:
    """The op's rows into `rows` (as they run: a hang's handler writes those so far) -> whether all passed."""
    gen = torch.Generator().manual_seed(11)
    ok = True
    for name, q_lens, seq_lens in STEPS:
        step = build_step(q_lens, seq_lens, gen)
        ref = reference(step)
        got_v, _, ms_v = run_op(step, "v2")
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        want_fresh = sorted(b for b, f in enumerate(fresh_long_prompts(qsl, seq_lens)) if f)
        want_chunks = sorted(b for b, f in enumerate(long_prefix_chunks(qsl, seq_lens)) if f)
        for choice in CHOICES:
            watchdog.arm(f"{name} {choice}")
            got, plan, ms = run_op(step, choice)
            watchdog.disarm()
            fresh, chunks = _sequences(plan.gluon_work), _sequences(plan.gluon_chunk_work)
            want = (want_fresh, want_chunks if choice == "gluon-chunks" else [])
            row = {"step": name, "choice": choice, "err": rel_err(got, ref), "err_v2": rel_err(got_v, ref),
                   "vs_v2": rel_err(got, got_v), "fresh_prompts": fresh, "chunks": chunks, "want": want,
                   "ms": ms, "ms_v2": ms_v, "finite": bool(torch.isfinite(got).all())}
            row["ok"] = row["finite"] and row["err"] < TOL and (fresh, chunks) == want
            ok &= row["ok"]
            rows.append(row)
            print(f"{name:44} {choice:13} err {row['err']:.2e} v2 {row['err_v2']:.2e} (vs v2 {row['vs_v2']:.2e})  "
                  f"fresh {fresh} chunks {chunks} (want {want[0]} {want[1]})  op {ms:.3f} ms vs v2 {ms_v:.3f} ms"
                  f"  {'ok' if row['ok'] else 'FAILED'}", flush=True)
    return ok


ENGINE_CHILD = r"""
import json, sys, torch
from kvfleet.engine.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams
model, lens, n, step = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(5)
prompts = [{"prompt_token_ids": torch.randint(10, 30000, (L,), generator=g).tolist()} for L in lens]
llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=8192, enforce_eager=True,
          max_num_batched_tokens=step)
outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def engine_tokens(model: str, choice: str) -> list[list[int]]:
    env = {**os.environ, "KVFLEET_PREFILL_KERNEL": choice}
    proc = subprocess.run([sys.executable, "-c", ENGINE_CHILD, model, json.dumps(ENGINE_PROMPTS), str(ENGINE_TOKENS),
                           str(ENGINE_STEP_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("TOKENS "):
            return json.loads(line[len("TOKENS "):])
    raise RuntimeError(f"engine with {choice} failed (rc {proc.returncode}): {proc.stderr[-2000:]}")


def main() -> int:
    out_dir = Path(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else "bench/models/qwen3-0.6b"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU (the Gluon kernel has no interpreter)", file=sys.stderr)
        return 2
    t0 = time.time()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "source": git_describe(), "op": []}

    def on_hang(label: str) -> None:
        result["hung"], result["ok"] = label, False
        (out_dir / "gluon_engine_check.json").write_text(json.dumps(result, indent=1))
        print(f"HUNG: {label} (no progress for the row's time limit): exit 3", flush=True)

    ok = op_rows(result["op"], Watchdog(on_hang))
    result["engine"] = {"model": model, "prompts": ENGINE_PROMPTS, "step_tokens": ENGINE_STEP_TOKENS}
    try:
        v2 = engine_tokens(model, "v2")
        result["engine"]["tokens_v2"] = v2
        for choice in CHOICES:
            got = engine_tokens(model, choice)
            same = sum(a == b for x, y in zip(v2, got, strict=True) for a, b in zip(x, y, strict=True))
            first = sum(x[0] == y[0] for x, y in zip(v2, got, strict=True))
            result["engine"][choice] = {"tokens": got, "same_tokens": same, "of": len(ENGINE_PROMPTS) * ENGINE_TOKENS,
                                        "same_first_tokens": first}
            print(f"engine {model} {choice}: {same} of {len(ENGINE_PROMPTS) * ENGINE_TOKENS} greedy tokens as v2's, "
                  f"first tokens {first} of {len(ENGINE_PROMPTS)}", flush=True)
    except Exception as e:  # noqa: BLE001 - the op's rows stand on their own
        result["engine"]["error"] = f"{type(e).__name__}: {e}"[:3000]
        print(f"engine check failed: {result['engine']['error']}", flush=True)
    result["ok"], result["seconds"] = ok, round(time.time() - t0, 1)
    (out_dir / "gluon_engine_check.json").write_text(json.dumps(result, indent=1))
    print(f"op check {'passed' if ok else 'FAILED'} in {result['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
