"""FP8 linear at small M on the GPU (issue 16): bf16, ``torch._scaled_mm`` and our Triton kernel side by side.
Usage:
    python bench/gpu_fp8_sweep.py OUT_DIR        (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU, interpreted)

For Llama-3.1-8B's four linear shapes (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) at
M = 1 .. 512 rows: bf16 ``F.linear``; the current FP8 path (per-token quant kernel + ``_scaled_mm`` row-wise);
``_scaled_mm`` alone, with and without ``use_fast_accum``; the quant kernel alone; our Triton GEMM
(``kernels/fp8_gemm.py``) at its default config (alone, with promotion to float32 every 128 K, and as the whole
linear with the quant launch) and at a grid of other tiles; and RMSNorm / SiLU-and-mul with the quantization
fused, against the kernel then the quant kernel (time, and bit-identical values and scales). Each time is the
median (CUDA events) of a CUDA graph that runs the op once per copy of the weights, divided by the copies: launch
gaps as in the engine's captured decode, and the weights read from HBM, not L2 (the copies span >= 200 MB, as
a decode step's layers do). Effective GB/s counts the weight bytes (bf16 or FP8). Errors: the FP8 results
against the float32 reference of the same quantized operands (Frobenius-relative and max|diff| / max|ref|).

Writes OUT_DIR/fp8_sweep.json and OUT_DIR/fp8_sweep.txt: per shape and M, the table; the best tile per shape
and M; the suggested ``KVFLEET_FP8_SMALL_M_MAX`` (the largest M up to which the Triton path, quant included,
beats the current path at every measured M, per shape and on the sum of the four shapes, i.e. per layer).
A failing measurement is recorded with its error, not fatal. ``SWEEP_BUDGET_S`` (default 80): the tile grid is
cut (and says so) when the run would pass it; the essential rows come first.
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
from kvfleet.engine.kernels.fp8_gemm import Fp8GemmConfig, default_config, fp8_gemm, num_sms  # noqa: E402
from kvfleet.engine.kernels.fp8_quant import per_token_quant_fp8  # noqa: E402
from kvfleet.engine.models.fp8 import quantize_per_row  # noqa: E402

from provenance import git_describe  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}   # N, K
MS = [1, 2, 16] if DRY else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ROTATE_BYTES = 200e6       # weight copies per measurement span this much (H200 L2: 50 MB)
MAX_COPIES = 16
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
        return {"rel_err": float("nan"), "max_rel_err": float("nan")}
    return {"rel_err": float((o - r).norm() / r.norm().clamp_min(1e-30)),
            "max_rel_err": float((o - r).abs().max() / r.abs().max().clamp_min(1e-30))}


class Shape:
    """One linear shape's operands: bf16 and FP8 weight copies (for rotation) and the activation per M."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name, self.n, self.k = name, n, k
        g = torch.Generator(device=DEV).manual_seed(sum(map(ord, name)))
        w = torch.randn(n, k, generator=g, device=DEV, dtype=torch.float32).mul_(0.02).to(BF16)
        self.bf16_bytes, self.fp8_bytes = n * k * 2, n * k
        n16 = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / self.bf16_bytes)))
        n8 = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / self.fp8_bytes)))
        if DRY:
            n16 = n8 = 1
        self.w16 = [w] + [w.clone() for _ in range(n16 - 1)]
        w_q, w_s = quantize_per_row(w)
        self.w8 = [(w_q, w_s)] + [(w_q.clone(), w_s.clone()) for _ in range(n8 - 1)]
        self.copies = {"bf16": n16, "fp8": n8, "none": 1 if DRY else 8}   # "none": the quant kernel alone

    def activation(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=DEV).manual_seed(m)
        x = torch.randn(m, self.k, generator=g, device=DEV, dtype=torch.float32).to(BF16)
        x_q, x_s = per_token_quant_fp8(x)
        return x, x_q, x_s

    def reference(self, x_q: torch.Tensor, x_s: torch.Tensor) -> torch.Tensor:
        w_q, w_s = self.w8[0]
        return (x_q.float() @ w_q.float().t()) * x_s * w_s.t()


def measure(rows: list[dict[str, Any]], shape: Shape, m: int, method: str, weights: str,
            make: Callable[[int], Callable[[], torch.Tensor]], ref: torch.Tensor | None,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time ``make(i)()`` over the weight copies; its error against ``ref`` on copy 0. Never raises."""
    row: dict[str, Any] = {"shape": shape.name, "M": m, "method": method, **(extra or {})}
    try:
        if ref is not None:
            row.update(errors(make(0)().float(), ref))
        ms, graphed = time_per_call([make(i) for i in range(shape.copies[weights])])
        nbytes = shape.bf16_bytes if weights == "bf16" else shape.fp8_bytes
        row.update(ms=ms, GBps=nbytes / (ms / 1e3) / 1e9 if weights != "none" else None, graph=graphed)
    except Exception as e:  # noqa: BLE001 - one failing config is a result, not the end of the run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["traceback"] = traceback.format_exc()[-1500:]
    rows.append(row)
    err = f" rel {row['rel_err']:.1e} max {row['max_rel_err']:.1e}" if "rel_err" in row else ""
    if "error" in row:
        say(f"  {shape.name:8} M={m:4} {method:34} FAILED {row['error'][:120]}")
    else:
        gbps = f"{row['GBps']:7.0f} GB/s" if row["GBps"] is not None else " " * 12
        say(f"  {shape.name:8} M={m:4} {method:34} {row['ms']:.4f} ms {gbps}{err}")
    return row


def scaled_mm(x_q: torch.Tensor, x_s: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], fast: bool) -> torch.Tensor:
    if DRY:   # PyTorch's CPU _scaled_mm takes one scale per tensor: the dry run's stand-in is its float32 formula
        return ((x_q.float() @ w[0].float().t()) * x_s * w[1].t()).to(BF16)
    return torch._scaled_mm(x_q, w[0].t(), scale_a=x_s, scale_b=w[1].reshape(1, -1), out_dtype=BF16,
                            use_fast_accum=fast)


def essentials(rows: list[dict[str, Any]], s: Shape, m: int) -> None:
    x, x_q, x_s = s.activation(m)
    ref = s.reference(x_q, x_s)
    cfg = default_config(m, s.n, s.k, num_sms(DEV))
    w16, w8 = s.w16, s.w8
    measure(rows, s, m, "bf16 F.linear", "bf16", lambda i: lambda: F.linear(x, w16[i]), None)
    measure(rows, s, m, "quant kernel alone", "none", lambda i: lambda: per_token_quant_fp8(x)[0], None)

    def current(i: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            q, sc = per_token_quant_fp8(x)
            return scaled_mm(q, sc, w8[i], False)
        return run

    measure(rows, s, m, "current: quant + _scaled_mm", "fp8", current, ref)
    measure(rows, s, m, "_scaled_mm", "fp8", lambda i: lambda: scaled_mm(x_q, x_s, w8[i], False), ref)
    measure(rows, s, m, "_scaled_mm fast_accum", "fp8", lambda i: lambda: scaled_mm(x_q, x_s, w8[i], True), ref)

    def triton_full(i: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            q, sc = per_token_quant_fp8(x)
            return fp8_gemm(q, sc, w8[i][0], w8[i][1], config=cfg)
        return run

    measure(rows, s, m, "triton: quant + gemm (default)", "fp8", triton_full, ref, {"config": cfg.label()})
    measure(rows, s, m, "triton gemm (default)", "fp8",
            lambda i: lambda: fp8_gemm(x_q, x_s, w8[i][0], w8[i][1], config=cfg), ref, {"config": cfg.label()})
    promo = Fp8GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, 128)
    measure(rows, s, m, "triton gemm (default, acc128)", "fp8",
            lambda i: lambda: fp8_gemm(x_q, x_s, w8[i][0], w8[i][1], config=promo), ref, {"config": promo.label()})


def grid_configs(m: int, n: int, k: int) -> list[Fp8GemmConfig]:
    """Tiles one step from the default in each direction: N block 32/64/128, K block 128/256, split 1, half,
    twice and four times the default's, warps 2/8, stages 3/5, half the M block at M >= 64 and 64-row blocks
    below; and N blocks of 16/32 without split-K."""
    base = default_config(m, n, k, num_sms(DEV))
    rep = dataclasses.replace
    cands = [rep(base, block_n=bn) for bn in (32, 64, 128)]
    cands += [rep(base, block_k=bk) for bk in (128, 256)]
    cands += [rep(base, split_k=s) for s in (1, max(1, base.split_k // 2), base.split_k * 2, base.split_k * 4)]
    cands += [rep(base, block_n=bn, split_k=1) for bn in (16, 32)]   # programs from N alone, no reduce launch
    cands += [rep(base, num_warps=w) for w in (2, 8)] + [rep(base, num_stages=p) for p in (3, 5)]
    if m >= 64:
        cands.append(rep(base, block_m=base.block_m // 2))
    else:   # 64-row tiles even for a few rows: Hopper's wgmma takes E4M3 directly (16/32 rows: mma.sync on fp16)
        cands += [rep(base, block_m=64, block_k=128), rep(base, block_m=64, block_k=256, num_stages=3)]
    out: list[Fp8GemmConfig] = []
    for cfg in cands:
        k_blocks = -(-k // cfg.block_k)
        if cfg != base and cfg not in out and (cfg.split_k == 1 or k_blocks // cfg.split_k >= 2):
            out.append(cfg)
    return out[:3] if DRY else out


def tile_grid(rows: list[dict[str, Any]], s: Shape, m: int) -> None:
    x, x_q, x_s = s.activation(m)
    ref = s.reference(x_q, x_s)
    w8 = s.w8
    for cfg in grid_configs(m, s.n, s.k):
        if time.monotonic() - T0 > BUDGET_S:
            rows.append({"shape": s.name, "M": m, "method": "triton gemm (grid)", "config": cfg.label(),
                         "skipped": "budget"})
            continue
        measure(rows, s, m, f"triton gemm {cfg.label()}", "fp8",
                lambda i, cfg=cfg: lambda: fp8_gemm(x_q, x_s, w8[i][0], w8[i][1], config=cfg), ref,
                {"config": cfg.label(), "grid": True})


def fused_quant(rows: list[dict[str, Any]], m: int) -> None:
    """RMSNorm (with the residual add) and SiLU-and-mul with the per-token quantization fused, against the
    kernel then the quant kernel; the fused values and scales must equal the unfused ones bit for bit."""
    from kvfleet.engine import kernels

    hidden, inter = scaled(4096), scaled(14336)
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, hidden, generator=g, device=DEV).to(BF16)
    res = torch.randn(m, hidden, generator=g, device=DEV).to(BF16)
    w = torch.rand(hidden, generator=g, device=DEV).add_(0.5).to(BF16)
    gu = torch.randn(m, 2 * inter, generator=g, device=DEV).mul_(3).to(BF16)
    pairs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "add+rms_norm": (lambda: kernels.fused_add_rms_norm_quant_fp8(x, res, w, 1e-5)[0],
                         lambda: per_token_quant_fp8(kernels.fused_add_rms_norm(x, res, w, 1e-5)[0])),
        "silu_and_mul": (lambda: kernels.silu_and_mul_quant_fp8(gu),
                         lambda: per_token_quant_fp8(kernels.silu_and_mul(gu))),
    }
    for name, (fused, unfused) in pairs.items():
        row: dict[str, Any] = {"shape": name, "M": m, "method": "fused quant"}
        try:
            qa, (q, sc) = fused(), unfused()
            row["bit_identical"] = bool(torch.equal(qa.values.view(torch.uint8), q.view(torch.uint8))
                                        and torch.equal(qa.scales, sc))
            row["fused_ms"] = time_per_call([fused] * (1 if DRY else 8))[0]
            row["unfused_ms"] = time_per_call([unfused] * (1 if DRY else 8))[0]
            say(f"  {name:12} M={m:4} fused {row['fused_ms']:.4f} ms, kernel + quant {row['unfused_ms']:.4f} ms, "
                f"bit-identical {row['bit_identical']}")
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            say(f"  {name:12} M={m:4} FAILED {row['error'][:120]}")
        rows.append(row)


def _ms(rows: list[dict[str, Any]], shape: str, m: int, method: str) -> float | None:
    for r in rows:
        if r["shape"] == shape and r["M"] == m and r["method"] == method and "ms" in r:
            return float(r["ms"])
    return None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Best tile per shape and M, and the suggested crossover. Both FP8 paths take the same quantized activation
    (the quant kernel, or the fused RMSNorm / SiLU-and-mul), so the choice is GEMM against GEMM: the best Triton
    tile against ``_scaled_mm``. Per M, a decoder layer's four linears: bf16, the current path (quant +
    ``_scaled_mm`` each), and the new path (estimate: the chosen GEMMs, plus the quant kernel for o alone, the
    other three inputs quantized inside the fused kernels)."""
    best: dict[str, dict[int, dict[str, Any]]] = {}
    for name in SHAPES:
        best[name] = {}
        for m in MS:
            gemms = [r for r in rows if r["shape"] == name and r["M"] == m and "ms" in r
                     and r["method"].startswith("triton gemm") and "acc128" not in r["method"]]
            sm = _ms(rows, name, m, "_scaled_mm")
            if not gemms or sm is None:
                continue
            b = min(gemms, key=lambda r: r["ms"])
            best[name][m] = {"config": b["config"], "gemm_ms": b["ms"],
                             "default_gemm_ms": _ms(rows, name, m, "triton gemm (default)"),
                             "scaled_mm_ms": sm, "fast_accum_ms": _ms(rows, name, m, "_scaled_mm fast_accum"),
                             "quant_ms": _ms(rows, name, m, "quant kernel alone"),
                             "current_path_ms": _ms(rows, name, m, "current: quant + _scaled_mm"),
                             "bf16_ms": _ms(rows, name, m, "bf16 F.linear"), "speedup_vs_scaled_mm": sm / b["ms"]}

    def crossover(wins: dict[int, bool]) -> int:
        last = 0
        for m in MS:
            if not wins.get(m, False):
                break
            last = m
        return last

    per_shape = {name: crossover({m: v["gemm_ms"] < v["scaled_mm_ms"] for m, v in b.items()})
                 for name, b in best.items()}
    full = [m for m in MS if all(m in best[name] for name in SHAPES)]
    suggested = crossover({m: sum(best[n][m]["gemm_ms"] for n in SHAPES) < sum(best[n][m]["scaled_mm_ms"]
                                                                               for n in SHAPES) for m in full})
    layer = {}
    for m in full:
        v = {n: best[n][m] for n in SHAPES}
        try:
            new = sum(x["gemm_ms"] if m <= suggested else x["scaled_mm_ms"] for x in v.values()) + v["o"]["quant_ms"]
            layer[m] = {"bf16_ms": sum(x["bf16_ms"] for x in v.values()),
                        "current_ms": sum(x["current_path_ms"] for x in v.values()), "new_estimate_ms": new}
        except TypeError:   # a missing measurement
            continue
    return {"best": best, "crossover_per_shape": per_shape, "suggested_small_m_max": suggested, "layer": layer}


def write(out: Path, report: dict[str, Any]) -> None:
    """Everything so far, with its summary (a run killed by a timeout leaves what it had)."""
    try:
        report["summary"] = summarize(report["rows"])
    except Exception as e:  # noqa: BLE001 - the rows are written regardless
        report["summary"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "fp8_sweep.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "fp8_sweep.txt").write_text("\n".join(RUN.lines) + "\n")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fp8-sweep-out")
    out.mkdir(parents=True, exist_ok=True)
    if DEV.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # the float32 reference in IEEE float32
    env = {"device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "cpu (dry run)",
           "sms": num_sms(DEV), "torch": torch.__version__, "triton": __import__("triton").__version__,
           "git": git_describe(), "dry_run": DRY, "iters": ITERS, "budget_s": BUDGET_S}
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {"env": env, "rows": rows}
    say(f"fp8 sweep on {env['device']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}")
    shapes = {name: Shape(name, scaled(n), scaled(k)) for name, (n, k) in SHAPES.items()}
    say("\n=== essentials: bf16, current path, _scaled_mm (fast accum), quant, Triton default")
    for m in MS:
        for s in shapes.values():
            essentials(rows, s, m)
        write(out, report)
    say(f"({time.monotonic() - T0:.1f} s)\n\n=== quantization fused into RMSNorm / SiLU-and-mul")
    for m in MS:
        fused_quant(rows, m)
    write(out, report)
    say(f"({time.monotonic() - T0:.1f} s)\n\n=== tile grid (Triton GEMM alone)")
    # spread over the range first, so a budget cut leaves coverage at every scale
    order = [m for m in (1, 16, 64, 256) if m in MS] + [m for m in MS if m not in (1, 16, 64, 256)]
    for m in order:
        for s in shapes.values():
            tile_grid(rows, s, m)
        write(out, report)
    skipped = sum(1 for r in rows if r.get("skipped"))
    say(f"({time.monotonic() - T0:.1f} s; {skipped} grid configs skipped for the budget)")
    summary = summarize(rows)
    say("\n=== per shape and M: best Triton tile against _scaled_mm (GEMM alone; both take the same quantized input)")
    for name, b in summary["best"].items():
        for m, v in b.items():
            say(f"  {name:8} M={m:4} best {v['config']:22} {v['gemm_ms']:.4f} ms (default {v['default_gemm_ms']:.4f})"
                f"  _scaled_mm {v['scaled_mm_ms']:.4f} (fast accum {v['fast_accum_ms']:.4f})  "
                f"x{v['speedup_vs_scaled_mm']:.2f}   bf16 {v['bf16_ms']:.4f}, quant {v['quant_ms']:.4f}")
    say(f"crossover per shape (largest M the best Triton tile wins at every M up to it): "
        f"{summary['crossover_per_shape']}")
    say(f"suggested KVFLEET_FP8_SMALL_M_MAX (sum of the four shapes): {summary['suggested_small_m_max']}")
    say("a decoder layer's four linears (ms): bf16 | current FP8 (quant + _scaled_mm x4) | new FP8 (estimate: "
        "chosen GEMMs + the quant kernel for o alone)")
    for m, v in summary["layer"].items():
        say(f"  M={m:4} {v['bf16_ms']:.4f} | {v['current_ms']:.4f} | {v['new_estimate_ms']:.4f}  "
            f"(new vs bf16 x{v['bf16_ms'] / v['new_estimate_ms']:.2f}, "
            f"vs current x{v['current_ms'] / v['new_estimate_ms']:.2f})")
    not_identical = [f"{r['shape']} M={r['M']}" for r in rows if r.get("bit_identical") is False]
    say(f"fused quantization not bit-identical to kernel + quant: {not_identical or 'none'}")
    failed = [f"{r['shape']} M={r['M']} {r['method']}" for r in rows if "error" in r]
    say(f"failed measurements: {len(failed)}" + (f" (first: {failed[:5]})" if failed else ""))
    say(f"total {time.monotonic() - T0:.1f} s")
    write(out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
