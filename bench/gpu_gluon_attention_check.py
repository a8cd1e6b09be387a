"""First GPU check of the Gluon FA3-style prefill kernel (kernels/prefill_attention_gluon.py): is it right, and how
fast is it against v2. Usage:
    python bench/gpu_gluon_attention_check.py OUT_DIR          (a Hopper GPU; no dry run: Gluon has no interpreter)

Llama-3.1-8B's attention (32 query heads, 8 KV heads, D 128), bf16, random inputs, k/v strided views of one fused qkv
projection (as the model's split hands them over). Cases: 1 x 8192, 2 x 4096, 8 x 1024 fresh prompts. Per case: a
float32 reference from the same bf16 inputs; v2 (`prefill_attention_v2` given k/v: its K/V tiles by TMA, the engine's
path for fresh prompts) at its default tile; the Gluon kernel at several (schedule, block_m, block_n, num_buffers,
num_warps), its default first; then, in a second pass over the cases (a deadlock there leaves the first pass whole),
the warp-specialized variant (schedule ``fa3-ws``/``ahead-ws``: a producer warp issues the TMA refills), and in a
third the two-consumer variants (``fa3-pp``: the two warpgroups take turns issuing their MMAs, FlashAttention-3's
ping-pong; ``fa3-ws2``/``ahead-ws2``: the same without the turns). GLUON_CHECK_PASSES ("1,3", say) picks passes.
Each row: max abs and relative (Frobenius) error against the reference and (first pass) against v2's output,
whether every row was written (``out`` starts as NaN), median ms of 20 (CUDA events, after warm-ups) and TFLOP/s of
the causal work (4 D FLOPs per visible (query, key, head)).
GLUON_CHECK_BUDGET_S (default 100): configurations past it are skipped.

A failing configuration is recorded with its error and the check goes on. A kernel that deadlocks (an mbarrier
waited at a phase that never completes) cannot be interrupted: a watchdog writes the row as hung after
``ROW_TIMEOUT_S`` and exits with status 3, keeping what ran. Writes OUT_DIR/gluon_attention_check.json (after every
row) and OUT_DIR/gluon_attention_check.txt.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvfleet.engine.bench.decode_probe import median_cuda_ms  # noqa: E402
from kvfleet.engine.kernels.prefill_attention import prefill_work  # noqa: E402
from kvfleet.engine.kernels.prefill_attention_v2 import default_tile_v2, prefill_attention_v2  # noqa: E402

from provenance import git_describe  # noqa: E402

HQ, HKV, D = 32, 8, 128
BF16 = torch.bfloat16
SCALE = D ** -0.5
CASES: list[tuple[str, list[int]]] = [("1 x 8192", [8192]), ("2 x 4096", [4096] * 2), ("8 x 1024", [1024] * 8)]
# (schedule, block_m, block_n, num_buffers, num_warps): the default first; "-ws": warp-specialized
GLUON_CONFIGS = [("fa3", 128, 128, 2, 8), ("ahead", 128, 64, 2, 8), ("fa3", 128, 128, 3, 8), ("fa3", 128, 64, 2, 8),
                 ("ahead", 128, 64, 3, 8), ("fa3", 64, 128, 2, 4)]
WS_CONFIGS = [("fa3-ws", 128, 128, 2, 8), ("ahead-ws", 128, 64, 2, 8), ("ahead-ws", 128, 64, 3, 8)]
# two consumer warpgroups (a third pass): taking turns (FlashAttention-3's ping-pong), then free
PP_CONFIGS = [("fa3-pp", 128, 128, 2, 8), ("fa3-ws2", 128, 128, 2, 8), ("ahead-ws2", 128, 64, 2, 8)]
ROW_TIMEOUT_S = float(os.environ.get("GLUON_CHECK_ROW_TIMEOUT_S", "40"))
BUDGET_S = float(os.environ.get("GLUON_CHECK_BUDGET_S", "100"))   # configurations past it are skipped
ITERS = 20


def causal_flops(q_lens: list[int]) -> float:
    return float(sum(4 * D * HQ * q * (q + 1) // 2 for q in q_lens))


def build_case(q_lens: list[int], gen: torch.Generator) -> dict[str, Any]:
    t = sum(q_lens)
    qkv = torch.randn(t, HQ + 2 * HKV, D, generator=gen).to(BF16).cuda()
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return {"q_lens": q_lens, "qsl_cpu": qsl, "qsl": torch.tensor(qsl, dtype=torch.int32, device="cuda"),
            "q": qkv[:, :HQ].contiguous(), "k": qkv[:, HQ:HQ + HKV], "v": qkv[:, HQ + HKV:]}


def reference(c: dict[str, Any]) -> torch.Tensor:
    """float32 causal attention of each prompt over its own keys, 8 heads at a time."""
    out = torch.empty(c["q"].shape, dtype=torch.float32, device="cuda")
    g = HQ // HKV
    for b in range(len(c["q_lens"])):
        lo, hi = c["qsl_cpu"][b], c["qsl_cpu"][b + 1]
        q = c["q"][lo:hi].float().transpose(0, 1)
        k, v = (x[lo:hi].float().repeat_interleave(g, dim=1).transpose(0, 1) for x in (c["k"], c["v"]))
        n = hi - lo
        hidden = torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1)
        for h0 in range(0, HQ, 8):
            s = (q[h0:h0 + 8] @ k[h0:h0 + 8].transpose(1, 2)) * SCALE
            p = torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)
            out[lo:hi, h0:h0 + 8] = (p @ v[h0:h0 + 8]).transpose(0, 1)
            del s, p
    return out


def v2_runner(c: dict[str, Any]) -> tuple[Callable[[], Any], torch.Tensor, list[int]]:
    """v2 given k/v, at its default tile: every key of a fresh prompt from k/v (the paged cache is never read)."""
    q_lens = c["q_lens"]
    bm, bn, warps, stages = tile = default_tile_v2(max(q_lens), BF16)
    seq_lens = torch.tensor(q_lens, dtype=torch.int32, device="cuda")
    cache = torch.zeros(2, 1, 16, HKV, D, dtype=BF16, device="cuda")
    tables = torch.zeros(len(q_lens), 1, dtype=torch.int32, device="cuda")
    work = prefill_work(c["qsl_cpu"], bm, False, "cuda", q_lens)
    out = torch.full_like(c["q"], float("nan"))

    def run() -> None:
        prefill_attention_v2(c["q"], cache, tables, seq_lens, c["qsl"], max(q_lens), SCALE, out, block_m=bm,
                             block_n=bn, work=work, num_warps=warps, num_stages=stages, k=c["k"], v=c["v"])
    return run, out, list(tile)


def gluon_runner(c: dict[str, Any], cfg: tuple[str, int, int, int, int]) -> tuple[Callable[[], Any], torch.Tensor]:
    from kvfleet.engine.kernels.prefill_attention_gluon import named_tile, prefill_attention_gluon

    sched, bm, bn, nb, warps = cfg
    tile = named_tile(sched, bm, bn, nb, warps)
    work = prefill_work(c["qsl_cpu"], bm, False, "cuda", c["q_lens"])
    out = torch.full_like(c["q"], float("nan"))

    def run() -> None:
        prefill_attention_gluon(c["q"], c["k"], c["v"], c["qsl"], max(c["q_lens"]), SCALE, out, work=work,
                                **dataclasses.asdict(tile))
    return run, out


def errors(got: torch.Tensor, ref: torch.Tensor, tag: str = "") -> dict[str, Any]:
    g, r = got.double(), ref.double()
    finite = bool(torch.isfinite(g).all())
    if not finite:   # a row left unwritten (NaN poison) or a NaN/inf computed: where
        bad = (~torch.isfinite(g)).any(dim=2).any(dim=1).nonzero().flatten()
        return {f"all_rows_written{tag}": False, f"first_bad_rows{tag}": bad[:8].tolist(),
                f"bad_rows{tag}": int(bad.numel())}
    return {f"max_abs_err{tag}": float((g - r).abs().max()),
            f"rel_err{tag}": float((g - r).norm() / r.norm().clamp_min(1e-30))}


class Watchdog:
    """Exit (status 3) when one row runs past ROW_TIMEOUT_S: a hung kernel blocks the main thread for good."""

    def __init__(self, on_hang: Callable[[str], None]) -> None:
        self.label: str | None = None
        self.since = 0.0
        self.on_hang = on_hang
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, label: str) -> None:
        self.label, self.since = label, time.monotonic()

    def disarm(self) -> None:
        self.label = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            label = self.label
            if label is not None and time.monotonic() - self.since > ROW_TIMEOUT_S:
                self.on_hang(label)
                os._exit(3)


def fmt(r: dict[str, Any]) -> str:
    head = f"{r['case']:10} {r['impl']:34}"
    if "error" in r or "skipped" in r or "hung" in r:
        return f"{head} {r.get('error') or r.get('skipped') or r.get('hung')}"
    errs = "  ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                     if k.startswith(("max_abs", "rel_err", "all_rows", "first_bad", "bad_rows")))
    timing = f"{r['ms']:8.3f} ms {r['TFLOPs']:6.1f} TFLOP/s" if "ms" in r else "(not timed)"
    return f"{head} {timing}  {errs}"


def write(out_dir: Path, report: dict[str, Any]) -> str:
    lines = [report["header"]] + [fmt(r) for r in report["rows"]]
    timed = [r for r in report["rows"] if "TFLOPs" in r]
    lines.append("\nbest per case (TFLOP/s):")
    for name, _ in CASES:
        best = {k: max((r for r in timed if r["case"] == name and r["impl"].startswith(k)),
                       key=lambda r: r["TFLOPs"], default=None) for k in ("v2", "gluon")}
        lines.append(f"  {name:10} " + "  ".join(f"{r['impl']} {r['TFLOPs']:.0f}" for r in best.values()
                                                 if r is not None))
    lines.append(f"\n{len(report['rows'])} rows, {sum('error' in r for r in report['rows'])} failed, "
                 f"{time.monotonic() - report['_t0']:.0f} s")
    text = "\n".join(lines) + "\n"
    (out_dir / "gluon_attention_check.json").write_text(
        json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=1, default=str) + "\n")
    (out_dir / "gluon_attention_check.txt").write_text(text)
    return text


def measure(row: dict[str, Any], run: Callable[[], Any], out: torch.Tensor, ref: torch.Tensor,
            v2_out: torch.Tensor | None, flops: float) -> None:
    t = time.monotonic()
    run()   # compiles (the first use of a config) and checks before timing
    torch.cuda.synchronize()
    row["first_call_s"] = time.monotonic() - t
    row.update(errors(out, ref))
    if v2_out is not None:
        row.update(errors(out, v2_out, "_vs_v2"))
    if row.get("all_rows_written") is False:
        return   # wrong: its time says nothing
    row["ms"] = median_cuda_ms(run, ITERS)
    row["TFLOPs"] = flops / (row["ms"] / 1e3) / 1e12


def run_case(name: str, c: dict[str, Any], ref: torch.Tensor, jobs: list[tuple[str, Any]], rows: list[dict[str, Any]],
             report: dict[str, Any], dog: Watchdog, out_dir: Path) -> None:
    """One case's rows (v2 first when asked: the other rows are compared with its output too)."""
    flops = causal_flops(c["q_lens"])
    v2_out = None
    for kind, cfg in jobs:
        row: dict[str, Any] = {"case": name, "q_lens": c["q_lens"], "flops": flops}
        if time.monotonic() - report["_t0"] > BUDGET_S:
            row.update(impl=f"{kind} {cfg}", skipped=f"past the {BUDGET_S:.0f} s budget")
            rows.append(row)
            print(fmt(row), flush=True)
            continue
        try:
            if kind == "v2":
                run, out, tile = v2_runner(c)
                row.update(impl=f"v2 {','.join(map(str, tile))} kv tma", tile=tile)
            else:
                sched, bm, bn, nb, warps = cfg
                row.update(impl=f"gluon {sched} {bm}x{bn} buf{nb} w{warps}", config=list(cfg))
                run, out = gluon_runner(c, cfg)
            dog.arm(f"{name}|{row['impl']}")
            measure(row, run, out, ref, v2_out, flops)
            if kind == "v2":
                v2_out = out.clone()
        except Exception as e:  # noqa: BLE001 - one failing configuration does not stop the check
            row.setdefault("impl", f"{kind} {cfg}")
            row["error"] = f"{type(e).__name__}: {e}"[:600]
            row["traceback"] = traceback.format_exc()[-2000:]
        dog.disarm()
        rows.append(row)
        print(fmt(row), flush=True)
        write(out_dir, report)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("gpu_gluon_attention_check: needs a CUDA GPU (a Hopper, compute capability 9.x); none is visible")
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "gluon-attention-check-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton

    report: dict[str, Any] = {"git": git_describe(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "capability": list(torch.cuda.get_device_capability()),
                              "heads": [HQ, HKV, D], "rows": [], "_t0": time.monotonic()}
    report["header"] = (f"Gluon FA3-style prefill check ({report['gpu']}, Hq {HQ} Hkv {HKV} D {D}, bf16, k/v views "
                        f"of a fused qkv); {report['git']}")
    print(report["header"], flush=True)
    rows: list[dict[str, Any]] = report["rows"]

    def on_hang(label: str) -> None:
        rows.append({"case": label.split("|")[0], "impl": label.split("|")[1],
                     "hung": f"no result after {ROW_TIMEOUT_S:.0f} s (a deadlock?): the check stopped here"})
        print(fmt(rows[-1]), flush=True)
        write(out_dir, report)

    dog = Watchdog(on_hang)
    passes = [(True, GLUON_CONFIGS), (False, WS_CONFIGS), (False, PP_CONFIGS)]
    if os.environ.get("GLUON_CHECK_PASSES"):   # e.g. "1,3": the default and the two-consumer variants only
        passes = [passes[int(i) - 1] for i in os.environ["GLUON_CHECK_PASSES"].split(",")]
    for first_pass, configs in passes:
        for i, (name, q_lens) in enumerate(CASES):
            c = build_case(q_lens, torch.Generator().manual_seed(90 + i))
            ref = reference(c)
            jobs: list[tuple[str, Any]] = ([("v2", None)] if first_pass else []) + [("gluon", g) for g in configs]
            run_case(name, c, ref, jobs, rows, report, dog, out_dir)
            del c, ref
            torch.cuda.empty_cache()
    text = write(out_dir, report)
    print(text[text.index("\nbest per case"):], flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
