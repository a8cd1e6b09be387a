"""bf16 linear layers at a few rows on the GPU (issue 16): cuBLAS (``F.linear``) against our Triton small-M GEMM
(``kernels/small_m_gemm.py``). Usage:
    python bench/gpu_small_m_gemm_sweep.py OUT_DIR        (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU, interpreted)

For Llama-3.1-8B's linear shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, LM head
128256x4096) at M = 1, 2, 4, 8, 16 rows: ``F.linear``, the Triton kernel at its default config
(``default_small_m_config``) and at ~10-12 configs around it (column and K block halved and doubled, split-K, warps,
stages, plain loads, the other multiply mode). Each time is the median (CUDA events) of a CUDA graph that runs the op
at least 8 times, cycling over copies of the weight that together span >= 200 MB, divided by the calls: launch gaps
as in the engine's captured decode step, the weights read from HBM and not the 50 MB L2. TB/s counts the weight
bytes. Errors: max |out - ref| and that over max |ref|, against the float32 product of the same bf16 operands.

Writes OUT_DIR/small_m_gemm_sweep.json and OUT_DIR/small_m_gemm_sweep.txt: the table; the best config per shape and
M; the suggested ``KVFLEET_SMALL_M_GEMM_MAX`` (the largest M up to which the default config beats cuBLAS at every M
and on every shape; also given for the best config, which tells whether the heuristic needs tuning); and a batch-1
decode step's linear layers for Llama-3.1-8B (32 decoder layers + the LM head) on cuBLAS and on the kernel. A
failing measurement is recorded with its error, not fatal. ``SWEEP_BUDGET_S`` (default 80): the config grid is cut
(and says so) when the run would pass it; cuBLAS and the default configs come first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import GpuReport  # noqa: E402

from kvfleet.engine.bench.decode_probe import ms_per_call  # noqa: E402
from kvfleet.engine.kernels._common import num_sms  # noqa: E402
from kvfleet.engine.kernels.small_m_gemm import SmallMGemmConfig, default_small_m_config, small_m_gemm  # noqa: E402

from provenance import git_describe  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}   # N, K
LAYER = ("qkv", "o", "gate_up", "down")
NUM_LAYERS = 32
MS = [1, 3] if DRY else [1, 2, 4, 8, 16]
ROTATE_BYTES = 200e6       # the weight copies of one measurement span this much (H200 L2: 50 MB)
MAX_COPIES = 16
MIN_CALLS = 8              # calls per graph, cycling over the copies: a graph launch is not one kernel's cost
ITERS = 20
BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", "80"))
T0 = time.monotonic()
RUN = GpuReport(on_cuda=DEV.type == "cuda")
say = RUN.say


def scaled(n: int) -> int:
    return max(16, n // 64) if DRY else n


def time_per_call(calls: list[Callable[[], Any]]) -> tuple[float, bool]:
    """(ms per call, whether a CUDA graph ran them): `decode_probe.ms_per_call` on this sweep's device."""
    return ms_per_call(calls, DEV, ITERS)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return {"max_abs_err": float("nan"), "max_rel_err": float("nan")}
    diff = float((o - r).abs().max())
    return {"max_abs_err": diff, "max_rel_err": diff / max(float(r.abs().max()), 1e-30)}


class Shape:
    """One linear shape's weight copies (for rotation) and, per M, an activation and its float32 reference."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        g = torch.Generator(device=DEV).manual_seed(sum(map(ord, name)))
        w = torch.randn(n, k, generator=g, device=DEV, dtype=torch.float32).mul_(0.02).to(BF16)
        self.bytes = n * k * 2
        copies = 1 if DRY else max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / self.bytes)))
        self.w = [w] + [w.clone() for _ in range(copies - 1)]
        self.calls = 1 if DRY else max(MIN_CALLS, copies)

    def activation(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=DEV).manual_seed(m)
        x = torch.randn(m, self.k, generator=g, device=DEV, dtype=torch.float32).to(BF16)
        return x, x.float() @ self.w[0].float().t()


def measure(rows: list[dict[str, Any]], s: Shape, m: int, method: str, op: Callable[[torch.Tensor], torch.Tensor],
            ref: torch.Tensor, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time ``op(w)`` over the weight copies; its error against ``ref`` on copy 0. Never raises."""
    row: dict[str, Any] = {"shape": s.name, "M": m, "method": method, **(extra or {})}
    try:
        row.update(errors(op(s.w[0]).float(), ref))
        weights = [s.w[i % len(s.w)] for i in range(s.calls)]
        ms, graphed = time_per_call([lambda w=w: op(w) for w in weights])
        row.update(us=ms * 1e3, TBps=s.bytes / (ms / 1e3) / 1e12, graph=graphed)
    except Exception as e:  # noqa: BLE001 - one failing config is a result, not the end of the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["traceback"] = traceback.format_exc()[-1500:]
    rows.append(row)
    if "error" in row:
        say(f"  {s.name:8} M={m:2} {method:32} FAILED {row['error'][:120]}")
    else:
        say(f"  {s.name:8} M={m:2} {method:32} {row['us']:9.2f} us {row['TBps']:5.2f} TB/s  "
            f"max err {row['max_abs_err']:.1e} (rel {row['max_rel_err']:.1e})")
    return row


def essentials(rows: list[dict[str, Any]], s: Shape, m: int) -> None:
    x, ref = s.activation(m)
    cfg = default_small_m_config(m, s.n, s.k, num_sms(DEV))
    measure(rows, s, m, "cublas F.linear", lambda w: F.linear(x, w), ref)
    measure(rows, s, m, f"triton default {cfg.label()}", lambda w: small_m_gemm(x, w, config=cfg), ref,
            {"config": cfg.label(), "default": True})


def grid_configs(m: int, n: int, k: int) -> list[SmallMGemmConfig]:
    """Configs one step from the default: column block and K block halved and doubled, split-K 1 and x2, warps 2
    and 8, plain loads (1 stage) and a stage more; elementwise, x rows loaded the other way (broadcast tiles
    where the default loads vectors) at the default's stages and at 3; the other multiply mode at its own default
    (elementwise only up to 4 rows); on the dot, 128-column blocks (wgmma)."""
    sms = num_sms(DEV)
    base = default_small_m_config(m, n, k, sms)
    rep = dataclasses.replace
    cands: list[Callable[[], SmallMGemmConfig]] = [
        lambda: rep(base, block_n=base.block_n // 2), lambda: rep(base, block_n=base.block_n * 2),
        lambda: rep(base, block_k=base.block_k // 2), lambda: rep(base, block_k=base.block_k * 2),
        lambda: rep(base, split_k=1), lambda: rep(base, split_k=base.split_k * 2),
        lambda: rep(base, num_warps=2), lambda: rep(base, num_warps=8),
        lambda: rep(base, num_stages=1), lambda: rep(base, num_stages=base.num_stages + 1),
    ]
    if not base.use_dot:
        cands.append(lambda: rep(base, x_vector=not base.x_vector))   # x rows as K vectors or as broadcast tiles
        cands.append(lambda: rep(base, x_vector=not base.x_vector, num_stages=3))
        cands.append(lambda: default_small_m_config(16, n, k, sms))   # the dot's tiling (x padded to 16 rows)
    elif m <= 4:
        cands.append(lambda: default_small_m_config(1, n, k, sms))    # elementwise's
    if base.use_dot:
        cands.append(lambda: rep(base, block_n=128, block_k=64))
    out: list[SmallMGemmConfig] = []
    for make in cands:
        try:
            cfg = make()
        except ValueError:   # out of the config's range (e.g. an elementwise block of 4 columns)
            continue
        # a K block past K, or more splits than K blocks, repeats another config
        useful = cfg.block_k < 2 * k and cfg.split_k <= -(-k // cfg.block_k)
        if useful and cfg != base and cfg not in out:
            out.append(cfg)
    return out[:3] if DRY else out


def tile_grid(rows: list[dict[str, Any]], s: Shape, m: int) -> None:
    x, ref = s.activation(m)
    for cfg in grid_configs(m, s.n, s.k):
        if time.monotonic() - T0 > BUDGET_S:
            rows.append({"shape": s.name, "M": m, "method": "triton (grid)", "config": cfg.label(),
                         "skipped": "budget"})
            continue
        measure(rows, s, m, f"triton {cfg.label()}", lambda w, cfg=cfg: small_m_gemm(x, w, config=cfg), ref,
                {"config": cfg.label(), "grid": True})


def _us(rows: list[dict[str, Any]], shape: str, m: int, pick: Callable[[dict[str, Any]], bool]) -> float | None:
    found = [r["us"] for r in rows if r["shape"] == shape and r["M"] == m and "us" in r and pick(r)]
    return min(found) if found else None


def crossover(wins: dict[int, bool]) -> int:
    """The largest M such that the kernel wins at every measured M up to it (0: not at M = 1)."""
    last = 0
    for m in MS:
        if not wins.get(m, False):
            break
        last = m
    return last


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best config per shape and M against cuBLAS; the crossover for the default and the best config; per M, the
    linear layers of a Llama-3.1-8B decode step (32 x (qkv + o + gate_up + down) + LM head)."""
    best: dict[str, dict[int, dict[str, Any]]] = {}
    for name in SHAPES:
        best[name] = {}
        for m in MS:
            cublas = _us(rows, name, m, lambda r: r["method"].startswith("cublas"))
            triton_rows = [r for r in rows if r["shape"] == name and r["M"] == m and "us" in r and "config" in r]
            default = _us(rows, name, m, lambda r: bool(r.get("default")))
            if cublas is None or not triton_rows:
                continue
            b = min(triton_rows, key=lambda r: r["us"])
            best[name][m] = {"config": b["config"], "best_us": b["us"], "best_TBps": b["TBps"], "default_us": default,
                             "cublas_us": cublas, "speedup_best": cublas / b["us"],
                             "speedup_default": cublas / default if default else None}
    full = [m for m in MS if all(m in best[name] for name in SHAPES)]
    default_wins = {m: all((best[n][m]["default_us"] or math.inf) < best[n][m]["cublas_us"] for n in SHAPES)
                    for m in full}
    best_wins = {m: all(best[n][m]["best_us"] < best[n][m]["cublas_us"] for n in SHAPES) for m in full}
    step = {}
    for m in full:
        per = {key: {n: best[n][m][key] for n in SHAPES} for key in ("cublas_us", "default_us", "best_us")}
        est = {}
        for key, times in per.items():
            if any(t is None for t in times.values()):
                continue
            layer = sum(times[n] for n in LAYER)
            est[key] = {"layer_us": layer, "lm_head_us": times["lm_head"],
                        "step_ms": (NUM_LAYERS * layer + times["lm_head"]) / 1e3}
        step[m] = est
    return {"best": best, "crossover_default": crossover(default_wins), "crossover_best": crossover(best_wins),
            "suggested_small_m_gemm_max": crossover(default_wins), "decode_step": step}


def write(out: Path, report: dict[str, Any]) -> None:
    """Everything so far, with its summary (a run killed by a timeout leaves what it had)."""
    try:
        report["summary"] = summarize(report["rows"])
    except Exception as e:  # noqa: BLE001 - the rows are written regardless
        report["summary"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "small_m_gemm_sweep.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "small_m_gemm_sweep.txt").write_text("\n".join(RUN.lines) + "\n")


def report_summary(summary: dict[str, Any]) -> None:
    say("\n=== per shape and M: the best Triton config against cuBLAS")
    for name, b in summary["best"].items():
        for m, v in b.items():
            default = f"{v['default_us']:8.2f}" if v["default_us"] is not None else "    n/a "
            say(f"  {name:8} M={m:2} best {v['config']:18} {v['best_us']:8.2f} us {v['best_TBps']:5.2f} TB/s  "
                f"default {default} us  cuBLAS {v['cublas_us']:8.2f} us  x{v['speedup_best']:.2f} (best)")
    say(f"crossover (largest M the kernel wins on every shape at every M up to it): default config "
        f"{summary['crossover_default']}, best config {summary['crossover_best']}")
    say(f"suggested KVFLEET_SMALL_M_GEMM_MAX: {summary['suggested_small_m_gemm_max']}")
    say(f"Llama-3.1-8B decode step, linear layers only ({NUM_LAYERS} x (qkv + o + gate_up + down) + LM head):")
    for m, est in summary["decode_step"].items():
        parts = "  ".join(f"{key[:-3]} {v['step_ms']:.3f} ms (layer {v['layer_us']:.1f} us, head "
                          f"{v['lm_head_us']:.1f} us)" for key, v in est.items())
        say(f"  M={m:2} {parts}")


def main() -> int:
    if not DRY and not torch.cuda.is_available():
        print("gpu_small_m_gemm_sweep: needs a CUDA GPU (KVFLEET_GPU_DRYRUN=1 runs tiny sizes on CPU, interpreted)",
              file=sys.stderr)
        return 2
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "small-m-gemm-sweep-out")
    out.mkdir(parents=True, exist_ok=True)
    if DEV.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # the float32 reference in IEEE float32
    env = {"device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu (dry run)",
           "sms": num_sms(DEV), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "git": git_describe(), "dry_run": DRY, "iters": ITERS, "budget_s": BUDGET_S}
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"env": env, "rows": rows}
    say(f"small-M GEMM sweep on {env['device']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}")
    shapes = {name: Shape(name, scaled(n), scaled(k)) for name, (n, k) in SHAPES.items()}
    say("\n=== cuBLAS and the Triton default config")
    for m in MS:
        for s in shapes.values():
            essentials(rows, s, m)
        write(out, report)
    say(f"({time.monotonic() - T0:.1f} s)\n\n=== config grid")
    order = [m for m in (1, 16, 4) if m in MS] + [m for m in MS if m not in (1, 16, 4)]   # coverage first
    for m in order:
        for s in shapes.values():
            tile_grid(rows, s, m)
        write(out, report)
    skipped = sum(1 for r in rows if r.get("skipped"))
    say(f"({time.monotonic() - T0:.1f} s; {skipped} grid configs skipped for the budget)")
    report_summary(summarize(rows))
    failed = [f"{r['shape']} M={r['M']} {r['method']}" for r in rows if "error" in r]
    say(f"failed measurements: {len(failed)}" + (f" (first: {failed[:5]})" if failed else ""))
    say(f"total {time.monotonic() - T0:.1f} s")
    write(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
