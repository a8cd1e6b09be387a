"""The same prefill steps and the same burst through one engine (kvfleet or vLLM, in process), timed and under
torch.profiler, so the two engines' kernel time can be put side by side by kind (GEMM, attention, norm, ...).
Usage:

    python bench/gpu_step_profile.py run --engine kvfleet|vllm --model DIR --out DIR [--scenarios a,b] [--dry]
    python bench/gpu_step_profile.py compare DIR    (both engines' JSON in DIR -> step_profile_compare.{json,txt})

Why: issue 16's 300-at-once row is the one online row under vLLM's on an H100 (TTFT p50 0.96), and its server-side
figures put the gap in the engine's steps (time to first token 3,792 against 3,658 ms), not in HTTP alone. A
profile of our steps alone cannot say which kernels are slower than theirs; one run of each engine over the same
work can. vLLM runs with VLLM_ENABLE_V1_MULTIPROCESSING=0, so its engine core and kernels are in this process and
the profiler sees them.

Scenarios (the online stage's limits: 8,192 batched tokens, 1,024 sequences; fresh seeded prompts every run, so no
prefix-cache hits):
- prefill-8x1024: one step of 8 fresh 1,024-token prompts (one output token): the burst's prefill step;
- prefill-1x8192: one step of one fresh 8,192-token prompt: the long-prompt class's;
- burst: 300 prompts of 1,024 tokens, 128 output tokens each, submitted at once (the online burst's work without
  HTTP): its whole run's kernels, prefill, mixed and decode steps together;
- burst-prefill: the same prompts to their first token only; `compare` takes it from the burst, kind by kind, for
  what the other 127 tokens of 300 sequences cost (decode attention at ~1k keys, small-M GEMMs);
- decode-192x512 and decode-192x512-prefill: the same at chat-mix's decode operating point (192 sequences, 512-token
  prompts, 128 decode steps over 513-640 keys), where Llama-3.1-8B's decode-only steps took 14.8 ms in lease 23;
- long-prompts: 12 prompts of 6,144 tokens, 32 output tokens each: at 8,192 tokens a step most prompts are split,
  so chunks over a cached prefix (the long-prompt row's remaining gap, the paged Gluon kernel against FA3) run
  beside fresh prompts and then ~6k-key decode steps.
Each is run once to warm, then timed (`--repeats`, median), then once under the profiler (device kernels only).
`--dry`: kvfleet on the CPU at 1/64 of the sizes with a tiny model; aten ops' CPU time stands in for kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_kinds import KernelTotal, kernel_totals, kind_rows, ms_by_kind  # noqa: E402

ENGINES = ("kvfleet", "vllm")
MAX_NUM_SEQS = 1024
MAX_NUM_BATCHED_TOKENS = 8192   # vLLM's online default, as in the online stage
MAX_MODEL_LEN = 8448            # one 8,192-token prompt and its output
DRY_MAX_MODEL_LEN = 256        # a tiny test model's positions
TOP_KERNELS = 40


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: int
    prompt_len: int
    output_len: int


SCENARIOS = {s.name: s for s in (Scenario("prefill-8x1024", 8, 1024, 1), Scenario("prefill-1x8192", 1, 8192, 1),
                                  Scenario("burst", 300, 1024, 128), Scenario("burst-prefill", 300, 1024, 1),
                                  Scenario("decode-192x512", 192, 512, 129),
                                  Scenario("decode-192x512-prefill", 192, 512, 1),
                                  Scenario("long-prompts", 12, 6144, 32))}
# kernel time of decoding: a run less the same prompts run to their first token (the burst's; and chat-mix's
# operating point, where most of its tokens come from decode-only steps at a mean batch of ~190 sequences of
# ~450-650 keys: lease 23, 14.8 ms a step)
DERIVED = {"burst decoding (burst less burst-prefill)": ("burst", "burst-prefill"),
           "decoding at B=192 (decode-192x512 less its prefill)": ("decode-192x512", "decode-192x512-prefill")}


def scaled(s: Scenario, dry: bool) -> Scenario:
    """At 1/64 of the lengths on the CPU (and at most 16 prompts), so a dry run takes seconds."""
    if not dry:
        return s
    return Scenario(s.name, min(s.prompts, 16), max(4, s.prompt_len // 64), max(1, min(s.output_len, 4)))


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        """Run the prompts to `max_tokens` output tokens each (ignoring EOS); returns the tokens produced."""
        ...

    def sync(self) -> None: ...


class KvfleetGenerator:
    def __init__(self, model: str, dry: bool) -> None:
        from kvfleet.engine.llm import LLM

        self.cuda = not dry
        self.llm = LLM(model, dtype="bfloat16" if self.cuda else "float32", device="cuda" if self.cuda else "cpu",
                       load_format="dummy", max_model_len=MAX_MODEL_LEN if self.cuda else DRY_MAX_MODEL_LEN,
                       max_num_seqs=MAX_NUM_SEQS,
                       max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, gpu_memory_utilization=0.9,
                       num_kv_blocks=None if self.cuda else 2048)
        self.llm.llm_engine.warm_up()   # as `kvfleet serve` does before /health (vLLM's LLM() warms up too)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from kvfleet.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


class VllmGenerator:
    def __init__(self, model: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process: its kernels profiled
        from vllm import LLM

        from kvfleet.engine.bench.vllm_backend import llm_kwargs

        args = argparse.Namespace(model=model, dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, gpu_memory_utilization=0.9,
                                  no_prefix_caching=False, enforce_eager=False, tensor_parallel_size=1,
                                  load_format="dummy", quantization=None, block_size=None, num_kv_blocks=None)
        self.llm = LLM(**llm_kwargs(args, MAX_MODEL_LEN))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> int:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize()


def vocab_size(model: str) -> int:
    return int(json.loads(Path(model, "config.json").read_text())["vocab_size"])


def prompts_for(s: Scenario, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token ids, a different set per seed (so a run finds nothing cached from the one before)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 32000), size=(s.prompts, s.prompt_len)).tolist()


def profiled(gen: Generator, prompts: list[list[int]], max_tokens: int, on_device: bool) -> list[KernelTotal]:
    from torch.profiler import ProfilerActivity, profile

    # device kernels only on a GPU: a burst launches ~10^5 of them, and the CPU ops' events would double that
    # acc_events: one cycle either way; without it torch warns that it clears events between cycles
    with profile(activities=[ProfilerActivity.CUDA] if on_device else [ProfilerActivity.CPU], acc_events=True) as prof:
        gen.generate(prompts, max_tokens)
        gen.sync()
    return kernel_totals(prof, on_device)


def run_scenario(gen: Generator, s: Scenario, vocab: int, repeats: int, on_device: bool) -> dict[str, Any]:
    seed = iter(range(1000 * len(s.name), 1000 * len(s.name) + 2 + repeats))
    gen.generate(prompts_for(s, vocab, next(seed)), s.output_len)   # warm
    wall_ms, tokens = [], 0
    for _ in range(repeats):
        prompts = prompts_for(s, vocab, next(seed))
        gen.sync()
        t = time.perf_counter()
        tokens = gen.generate(prompts, s.output_len)
        gen.sync()
        wall_ms.append((time.perf_counter() - t) * 1e3)
    totals = profiled(gen, prompts_for(s, vocab, next(seed)), s.output_len, on_device)
    by_kind = ms_by_kind(totals)
    return {"scenario": asdict(s), "wall_ms": wall_ms, "wall_ms_median": statistics.median(wall_ms),
            "output_tokens": tokens, "kernel_ms_total": sum(by_kind.values()), "kernel_ms_by_kind": by_kind,
            "kernels_launched": sum(t.calls for t in totals),
            "top_kernels": [asdict(t) for t in totals[:TOP_KERNELS]]}


def run(args: argparse.Namespace) -> int:
    if args.dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.engine == "vllm" and args.dry:
        raise SystemExit("--dry runs kvfleet only (vLLM needs its GPU wheels)")
    t = time.monotonic()
    gen: Generator = VllmGenerator(args.model) if args.engine == "vllm" else KvfleetGenerator(args.model, args.dry)
    result: dict[str, Any] = {"engine": args.engine, "model": args.model, "dry": args.dry,
                              "init_s": time.monotonic() - t, "commit": os.environ.get("KVFLEET_COMMIT"),
                              "limits": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                                         "max_model_len": MAX_MODEL_LEN},
                              "scenarios": {}}
    print(f"{args.engine}: ready in {result['init_s']:.1f} s", flush=True)
    vocab = vocab_size(args.model)
    for name in args.scenarios:
        s = scaled(SCENARIOS[name], args.dry)
        res = run_scenario(gen, s, vocab, args.repeats, on_device=not args.dry)
        result["scenarios"][name] = res
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in res["kernel_ms_by_kind"].items() if v)
        print(f"{args.engine} {name}: wall {res['wall_ms_median']:.1f} ms (median of {args.repeats}), kernels "
              f"{res['kernel_ms_total']:.1f} ms: {kinds}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"step_profile_{args.engine}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {path}")
    return 0


def comparison(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Per scenario both engines had: wall medians and kernel ms by kind, kvfleet's over vLLM's; and the derived
    rows (one scenario's kernels less another's) where both engines ran both."""
    out: dict[str, Any] = {}
    for name, a in ours["scenarios"].items():
        b = theirs["scenarios"].get(name)
        if b is None:
            continue
        out[name] = {"wall_ms": {"ours": a["wall_ms_median"], "theirs": b["wall_ms_median"],
                                 "ratio": a["wall_ms_median"] / b["wall_ms_median"]},
                     "kinds": kind_rows(a["kernel_ms_by_kind"], b["kernel_ms_by_kind"]),
                     "kernels_launched": {"ours": a["kernels_launched"], "theirs": b["kernels_launched"]}}
    for name, (whole, part) in DERIVED.items():
        if whole in out and part in out:
            out[name] = {"kinds": kind_rows(_less(ours, whole, part), _less(theirs, whole, part))}
    return out


def _less(result: dict[str, Any], whole: str, part: str) -> dict[str, float]:
    a, b = (result["scenarios"][s]["kernel_ms_by_kind"] for s in (whole, part))
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}


def comparison_text(cmp: dict[str, Any], ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    lines = []
    for name, c in cmp.items():
        if "wall_ms" in c:
            w = c["wall_ms"]
            lines.append(f"## {name}: wall {w['ours']:.1f} ms (kvfleet) against {w['theirs']:.1f} ms (vLLM), "
                         f"x{w['ratio']:.3f}; kernels launched {c['kernels_launched']['ours']} against "
                         f"{c['kernels_launched']['theirs']}")
        else:
            lines.append(f"## {name}")
        lines += ["", "| kind | kvfleet ms | vLLM ms | diff ms | kvfleet / vLLM |", "| --- | --- | --- | --- | --- |"]
        for r in c["kinds"]:
            ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}"
            lines.append(f"| {r['kind']} | {r['ours_ms']:.2f} | {r['theirs_ms']:.2f} | {r['diff_ms']:+.2f} | {ratio} |")
        if name in ours["scenarios"]:
            for label, res in (("kvfleet", ours), ("vLLM", theirs)):
                lines += ["", f"{label}'s longest kernels (ms in all, calls, us a call: median / p90):"]
                for k in res["scenarios"][name]["top_kernels"][:15]:
                    each = f"{k.get('median_us', 0.0):8.1f} / {k.get('p90_us', 0.0):8.1f} us"   # lease <= 25: none
                    lines.append(f"  {k['ms']:9.2f} ms {k['calls']:7d}x {each}  {k['kind']:16} {k['name'][:100]}")
        lines.append("")
    return "\n".join(lines) + "\n"


def compare(folder: Path) -> int:
    paths = [folder / f"step_profile_{e}.json" for e in ENGINES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"compare: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    ours, theirs = (json.loads(p.read_text()) for p in paths)
    cmp = comparison(ours, theirs)
    (folder / "step_profile_compare.json").write_text(json.dumps(cmp, indent=1) + "\n")
    text = comparison_text(cmp, ours, theirs)
    (folder / "step_profile_compare.txt").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--engine", required=True, choices=ENGINES)
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--scenarios", type=lambda v: [x for x in v.split(",") if x], default=list(SCENARIOS))
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--dry", action="store_true", help="kvfleet on the CPU at 1/64 of the sizes")
    c = sub.add_parser("compare")
    c.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.folder)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
