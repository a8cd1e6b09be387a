"""Fresh prompts' attention on the GPU (issue 16, long-prompt row): our v2 prefill kernel as the engine runs it
(new K/V by TMA) against PyTorch's fused SDPA kernels as `attention.fresh_prompts` calls them. Usage:
    python bench/gpu_fresh_prompts.py OUT_DIR          (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU, interpreted)

Llama-3.1-8B's attention (32 query heads, 8 KV heads, D 128), bf16; q/k/v as views of one fused projection, as
the model hands them over. Three parts, written to OUT_DIR/fresh_prompts.json and .txt:
1. isolated, fresh prompts only (1 x 8192, 2 x 4096, 1 x 6200, 8 x 1024): median ms (CUDA events), TFLOP/s of
   the causal work, error against a float32 reference; SDPA per backend, at the engine's 256-token bucket and
   at the exact length;
2. cuDNN's cost at a length it has not seen (it builds an execution plan per shape): wall time of the first call
   at new lengths against a warm call;
3. the whole attention op (`triton_paged_attention`: cache write, prefill kernel, decode rows) on a step shaped
   like the long-prompt row's mixed steps, with KVFLEET_SDPA_PREFILL off and per backend.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_attention_sweep as sweep  # noqa: E402

from kvfleet.engine.attention import fresh_prompts as fp  # noqa: E402
from kvfleet.engine.attention import triton_backend  # noqa: E402
from kvfleet.engine.attention.triton_backend import triton_paged_attention  # noqa: E402

from provenance import git_describe  # noqa: E402

DEV, S, HQ, D = sweep.DEV, sweep.S, sweep.HQ, sweep.D
BACKENDS = ["math"] if DRY else ["cudnn", "flash", "efficient"]
BUCKET = S(256) if DRY else 256
CASES: list[tuple[str, list[int]]] = [
    ("1 x 8192", [S(8192)]), ("2 x 4096", [S(4096)] * 2), ("1 x 6200", [S(6200)]), ("8 x 1024", [S(1024)] * 8),
]
# the long-prompt row's mixed step: the tail of one prompt over its cached head, two whole prompts, the head of
# the next, and decode rows of earlier prompts
STEP_Q = [S(3000), S(6200), S(6200), S(984)] + [1] * 48
STEP_CTX = [S(3200), 0, 0, 0] + [S(6200)] * 48


def sdpa_runner(c: dict[str, Any], config: fp.SdpaPrefillConfig
                ) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    out = torch.full_like(c["q"], float("nan"))
    qsl = c["md"].query_start_loc_cpu
    seqs = tuple(range(len(c["q_lens"])))

    def run() -> None:
        fp.attend_fresh_prompts(c["q"], c["k"], c["v"], out, qsl, seqs, sweep.SCALE, config)
    return run, lambda: out


def isolated(rows: list[dict[str, Any]]) -> None:
    gen = torch.Generator().manual_seed(16)
    for name, q_lens in CASES:
        c = sweep.build_case(q_lens, [0] * len(q_lens), gen)
        ref = sweep.reference(c)
        flops = sweep.causal_flops(q_lens, [0] * len(q_lens))
        impls: list[tuple[str, Callable[[], tuple[Callable[[], Any], Callable[[], torch.Tensor]]]]] = [
            ("v2 tma (engine)", lambda c=c: sweep.kernel_runner(c, "v2 contiguous kv tma", sweep.V2_DEFAULT))]
        for b in BACKENDS:
            impls.append((f"sdpa {b} bucket {BUCKET}",
                          lambda c=c, b=b: sdpa_runner(c, fp.SdpaPrefillConfig(b, 2, BUCKET))))
            impls.append((f"sdpa {b} exact", lambda c=c, b=b: sdpa_runner(c, fp.SdpaPrefillConfig(b, 2, 1))))
        for impl, make in impls:
            row: dict[str, Any] = {"part": "isolated", "case": name, "impl": impl, "flops": flops}
            try:
                run, result = make()
                t = time.monotonic()
                run()
                if DEV.type == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = time.monotonic() - t
                row.update(sweep.errors(result(), ref))
                row["ms"] = row["first_call_s"] * 1e3 if DRY else sweep.bench_ms(run)
                row["TFLOPs"] = flops / (row["ms"] / 1e3) / 1e12
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape: recorded, the rest runs
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(fmt(row), flush=True)
        del c, ref
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


def cold_calls(rows: list[dict[str, Any]]) -> None:
    """First call at lengths this process has not run (a new execution plan each for cuDNN) against a warm one."""
    gen = torch.Generator().manual_seed(17)
    for b in BACKENDS:
        for bucket, lengths in ((1, [S(5001), S(5002), S(5003)]), (BUCKET, [S(5100), S(5400), S(5650)])):
            for n in lengths:
                row: dict[str, Any] = {"part": "cold", "impl": f"sdpa {b} bucket {bucket}", "case": f"1 x {n}"}
                try:
                    c = sweep.build_case([n], [0], gen)
                    run, _ = sdpa_runner(c, fp.SdpaPrefillConfig(b, 2, bucket))
                    if DEV.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.monotonic()
                    run()
                    if DEV.type == "cuda":
                        torch.cuda.synchronize()
                    row["first_call_ms"] = (time.monotonic() - t) * 1e3
                    row["ms"] = row["first_call_ms"] if DRY else sweep.bench_ms(run)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                rows.append(row)
                print(fmt(row), flush=True)


def whole_op(rows: list[dict[str, Any]]) -> None:
    """`triton_paged_attention` on the long-prompt row's mixed step, SDPA off and per backend."""
    gen = torch.Generator().manual_seed(18)
    c = sweep.build_case(STEP_Q, STEP_CTX, gen)
    md = c["md"]
    flops = sweep.causal_flops(STEP_Q, STEP_CTX)
    outs: dict[str, torch.Tensor] = {}
    saved = triton_backend.SDPA_PREFILL
    try:
        for b in [None] + BACKENDS:
            config = fp.SdpaPrefillConfig(b, 1024 if not DRY else 2, BUCKET)
            row: dict[str, Any] = {"part": "op", "case": "long-prompt mixed step", "impl": f"op, sdpa {b or 'off'}",
                                   "flops": flops}
            triton_backend.SDPA_PREFILL = config

            def run() -> torch.Tensor:
                md.plans.clear()   # plan per call, as each step does
                return triton_paged_attention(c["q"], c["k"], c["v"], c["cache"], md, sweep.SCALE)
            try:
                outs[row["impl"]] = run()
                row["fresh_seqs"] = list(md.plans["triton_prefill"].fresh)   # type: ignore[attr-defined]
                row["ms"] = (0.0 if DRY else sweep.bench_ms(run))
                row["TFLOPs"] = flops / (row["ms"] / 1e3) / 1e12 if row["ms"] else 0.0
                base = outs.get("op, sdpa off")
                if base is not None:
                    row.update({f"vs_off_{k}": v for k, v in sweep.errors(outs[row["impl"]], base.float()).items()})
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(fmt(row), flush=True)
    finally:
        triton_backend.SDPA_PREFILL = saved


def fmt(r: dict[str, Any]) -> str:
    head = f"{r['part']:9} {r['case']:24} {r['impl']:28}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    parts = [f"{r['ms']:9.3f} ms"]
    if "TFLOPs" in r:
        parts.append(f"{r['TFLOPs']:6.1f} TFLOP/s")
    if "first_call_ms" in r:
        parts.append(f"first call {r['first_call_ms']:8.1f} ms")
    if "rel_err" in r:
        parts.append(f"max abs err {r['max_abs_err']:.2e} rel {r['rel_err']:.2e}")
    if "vs_off_rel_err" in r:
        parts.append(f"vs off: max abs {r['vs_off_max_abs_err']:.2e} rel {r['vs_off_rel_err']:.2e}")
    return f"{head} " + "  ".join(parts)


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "fresh-prompts-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"git": git_describe(), "dry_run": DRY, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else None,
                              "cudnn": torch.backends.cudnn.version() if DEV.type == "cuda" else None,
                              "bucket": BUCKET, "rows": []}
    header = (f"fresh prompts: v2 against SDPA ({report['gpu'] or 'CPU, dry run'}, cuDNN {report['cudnn']}, "
              f"Hq {HQ} Hkv {sweep.HKV} D {D}, bf16); {report['git']}")
    print(header, flush=True)
    t0 = time.monotonic()
    for part in (isolated, cold_calls, whole_op):
        part(report["rows"])
        report["seconds"] = time.monotonic() - t0
        (out_dir / "fresh_prompts.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text = "\n".join([header] + [fmt(r) for r in report["rows"]] + [f"{report['seconds']:.0f} s"]) + "\n"
    (out_dir / "fresh_prompts.txt").write_text(text)
    print(f"written to {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
