"""Kernel checks and timings at real sizes in bfloat16 on a CUDA GPU (one call of bench/gpu_run.sh).

Each kernel runs on fresh random inputs against its PyTorch reference (float32
math), outputs poisoned with NaN first; then the decode and prefill attention
kernels are timed (CUDA events, median) against the bytes/FLOPs they must move,
with the measured copy bandwidth and matmul rate as ceilings, and a few decode
tile configurations are swept. Writes one JSON (argv[1]) and prints a table.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

# Dry run on CPU (TRITON_INTERPRET=1, tiny sizes) to check this script itself before spending GPU time.
DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention  # noqa: E402
from kvfleet.engine.attention.triton_backend import triton_paged_attention  # noqa: E402
from kvfleet.engine.bench.decode_probe import median_cuda_ms  # noqa: E402
from kvfleet.engine.kernels import (  # noqa: E402
    apply_rotary_cos_sin,
    fused_add_rms_norm,
    paged_attention_ref,
    paged_decode_attention,
    prefill_attention,
    reshape_and_cache,
    reshape_and_cache_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_mul_ref,
)
from kvfleet.engine.kernels.prefill_attention import prefill_work  # noqa: E402
from kvfleet.engine.models.layers import RotaryEmbedding, apply_rotary  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BF16 = torch.bfloat16


def S(n: int) -> int:
    """Problem sizes: real on the GPU, divided by 64 in a dry run."""
    return max(1, n // 64) if DRY else n


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def bench_ms(fn: Callable[[], Any], iters: int = 30) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return median_cuda_ms(fn, iters)


def ceilings() -> dict[str, float]:
    x = torch.randn(S(2 * 2**30 // 2), dtype=BF16, device=DEV)  # 2 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), 20)
    bw = 2 * x.numel() * 2 / (ms / 1e3)
    x = y = None  # free the 4 GiB before the matmuls
    n = S(8192)
    a = torch.randn(n, n, dtype=BF16, device=DEV)
    b = torch.randn(n, n, dtype=BF16, device=DEV)
    mm = bench_ms(lambda: a @ b, 10)
    return {"copy_bw_GBps": bw / 1e9, "bf16_matmul_TFLOPs": 2 * n**3 / (mm / 1e3) / 1e12}


def paged_case(batch: int, seq_lens: list[int], q_lens: list[int], hq: int, hkv: int, d: int = 128,
               block_size: int = 16) -> dict[str, Any]:
    nb = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(nb) + 8
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n])
        i += n
    md = build_attention_metadata(q_lens, seq_lens, tables, block_size, DEV)
    t = sum(q_lens)
    return dict(
        md=md, cache=torch.randn(2, num_blocks, block_size, hkv, d, device=DEV).to(BF16),
        q=torch.randn(t, hq, d, device=DEV).to(BF16), k=torch.randn(t, hkv, d, device=DEV).to(BF16),
        v=torch.randn(t, hkv, d, device=DEV).to(BF16),
    )


def check_kernels() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(name: str, err: float, tol: float) -> None:
        rows.append({"check": name, "rel_err": err, "tol": tol, "ok": bool(err < tol)})

    g = torch.Generator(device="cpu").manual_seed(int(time.time()))
    # reshape_and_cache: exact
    c = paged_case(S(64), torch.randint(1, S(3000) + 1, (S(64),), generator=g).tolist(), [1] * S(64), 32, 8)
    got, ref = c["cache"].clone(), c["cache"].clone()
    reshape_and_cache(c["k"], c["v"], got, c["md"].slot_mapping)
    reshape_and_cache_ref(c["k"], c["v"], ref, c["md"].slot_mapping)
    add("reshape_and_cache exact", 0.0 if torch.equal(got, ref) else 1.0, 0.5)
    # decode: Llama (32/8) and Qwen3 (16/8) heads, split and unsplit, long contexts
    for (b, hq, hkv, maxlen, splits) in [(256, 32, 8, 2048, 1), (256, 16, 8, 2048, 1), (4, 32, 8, 32768, 16),
                                         (3, 16, 8, 9000, 7)]:
        b, maxlen = S(b), S(maxlen) + 2
        lens = torch.randint(1, maxlen, (b,), generator=g).tolist()
        c = paged_case(b, lens, [1] * b, hq, hkv)
        md = c["md"]
        out = torch.full_like(c["q"], float("nan"))
        paged_decode_attention(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc, 0.088, out,
                               num_splits=splits)
        ref = paged_attention_ref(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc, 0.088)
        add(f"decode B={b} H={hq}/{hkv} ctx<{maxlen} splits={splits}", rel_err(out, ref), 2e-2)
    # prefill / chunked prefill with cached prefixes, plus a mixed step through the backend op
    for (q_lens, prefix, hq) in [([2048, 517, 1000, 64], [0, 1500, 3000, 0], 32),
                                 ([300, 1, 1, 1200, 1], [0, 900, 40, 700, 5000], 16)]:
        q_lens = [q if q == 1 else S(q) for q in q_lens]
        prefix = [S(p) for p in prefix]
        seq_lens = [p + q for p, q in zip(prefix, q_lens, strict=True)]
        c = paged_case(len(q_lens), seq_lens, q_lens, hq, 8)
        md = c["md"]
        cache_ref = c["cache"].clone()
        out = triton_paged_attention(c["q"], c["k"], c["v"], c["cache"], md, 0.088)
        torch_paged_attention(c["q"], c["k"], c["v"], cache_ref, md, 0.088)
        ref = paged_attention_ref(c["q"], cache_ref, md.block_tables, md.seq_lens, md.query_start_loc, 0.088)
        add(f"prefill+decode op q={q_lens} prefix={prefix} H={hq}/8", rel_err(out, ref), 2e-2)
        add("  same cache as torch op", 0.0 if torch.equal(c["cache"], cache_ref) else 1.0, 0.5)
    # pointwise kernels at model sizes
    x = torch.randn(S(4096), 4096, device=DEV).to(BF16)
    r = torch.randn(S(4096), 4096, device=DEV).to(BF16)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(BF16)
    add("rms_norm 4096", rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)[0]), 1e-2)
    o, h = fused_add_rms_norm(x, r, w, 1e-5)
    ro, rh = rms_norm_ref(x, w, 1e-5, residual=r)
    add("fused add+rms_norm (bit-exact vs HF numerics)", 0.0 if (torch.equal(o, ro) and torch.equal(h, rh))
        else rel_err(o, ro), 1e-2)
    gu = torch.randn(S(4096), 2 * 14336, device=DEV).to(BF16)
    add("silu_and_mul 14336", rel_err(silu_and_mul(gu), silu_mul_ref(gu[:, :14336], gu[:, 14336:])), 1e-2)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope = RotaryEmbedding(128, 500000.0, scaling).to(DEV)
    pos = torch.randint(0, 100000, (S(4096),), device=DEV)
    cos, sin = rope(pos, BF16)
    qkv = torch.randn(S(4096), 48, 128, device=DEV).to(BF16)
    q, k = qkv[:, :32], qkv[:, 32:40]
    rq, rk = apply_rotary(q.float(), cos.float(), sin.float()), apply_rotary(k.float(), cos.float(), sin.float())
    apply_rotary_cos_sin(q, k, cos, sin)
    add("rotary llama3 (q,k in place)", max(rel_err(q, rq), rel_err(k, rk)), 1e-2)
    return rows


def time_kernels(bw: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # decode at batch 256, context 1024, Llama heads: bytes = K+V of every context token
    for (b, ctx, hq, name) in [(256, 1024, 32, "llama"), (256, 1024, 16, "qwen3"), (1, 32768, 32, "llama")]:
        b, ctx = S(b), S(ctx)
        c = paged_case(b, [ctx] * b, [1] * b, hq, 8)
        md = c["md"]
        kv_bytes = b * ctx * 8 * 128 * 2 * 2
        floor_ms = kv_bytes / bw * 1e3
        out = torch.empty_like(c["q"])
        base = {"kernel": f"decode {name} B={b} ctx={ctx}", "floor_ms": floor_ms}
        configs = [(1, 64, 4, 3), (1, 64, 4, 2), (1, 128, 4, 3), (1, 64, 8, 3), (1, 128, 8, 3)]
        if b == 1:
            configs = [(s, 64, 4, 2) for s in (1, 8, 16, 32)]
        for splits, bn, warps, stages in configs:
            fn = _decode_fn(c, out, splits, bn, warps, stages)
            ms = bench_ms(fn)
            rows.append({**base, "config": f"splits={splits} BLOCK_N={bn} warps={warps} stages={stages}",
                         "ms": ms, "GBps": kv_bytes / (ms / 1e3) / 1e9, "x_floor": ms / floor_ms})
        if b > 1:
            ms = bench_ms(functools.partial(torch_paged_attention, c["q"], c["k"], c["v"], c["cache"], md, 0.088), 10)
            rows.append({**base, "config": "torch reference op (gather+einsum)", "ms": ms,
                         "GBps": kv_bytes / (ms / 1e3) / 1e9, "x_floor": ms / floor_ms})
    # prefill: 8 sequences of 1024 new tokens, causal; FLOPs = 4 * sum(L^2/2) * H * D
    q_lens = [S(1024)] * 8
    c = paged_case(8, q_lens, q_lens, 32, 8)
    md = c["md"]
    out = torch.empty_like(c["q"])
    flops = 4 * sum(L * L / 2 for L in q_lens) * 32 * 128
    for bm, warps, stages in ((64, 4, 2), (64, 4, 3), (128, 8, 2), (128, 4, 2)):
        work = prefill_work(md.query_start_loc_cpu, bm, False, DEV)
        ms = bench_ms(functools.partial(prefill_attention, c["q"], c["cache"], md.block_tables, md.seq_lens,
                                        md.query_start_loc, q_lens[0], 0.088, out, block_m=bm,
                                        work=work, num_warps=warps, num_stages=stages))
        rows.append({"kernel": "prefill llama 8x1024 causal", "config": f"BLOCK_M={bm} warps={warps} "
                     f"stages={stages}", "ms": ms, "TFLOPs": flops / (ms / 1e3) / 1e12})
    return rows


def _decode_fn(c: dict[str, Any], out: torch.Tensor, splits: int, bn: int, warps: int, stages: int):
    import kvfleet.engine.kernels.paged_decode as pd

    md = c["md"]

    def fn() -> None:
        pd.paged_decode_attention(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc, 0.088,
                                  out, num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages)
    return fn


def main(argv: list[str]) -> int:
    out_path = argv[1] if len(argv) > 1 else "kernels.json"
    torch.manual_seed(int(time.time()))
    res: dict[str, Any] = {"gpu": None if DRY else torch.cuda.get_device_name(0), "torch": torch.__version__}
    res["ceilings"] = ceilings()
    res["checks"] = check_kernels()
    res["timings"] = time_kernels(res["ceilings"]["copy_bw_GBps"] * 1e9)
    # the fastest decode tile at batch 256 (Llama heads) for the rest of this run (bench/gpu_run.sh)
    sweep = [t for t in res["timings"] if t["kernel"].startswith("decode llama B=") and "BLOCK_N" in t["config"]
             and "splits=1 " in t["config"]]
    if sweep:
        best = min(sweep, key=lambda t: t["ms"])
        cfg = dict(kv.split("=") for kv in best["config"].split())
        res["best_decode_tile"] = f"{cfg['BLOCK_N']},{cfg['warps']},{cfg['stages']}"
        with open(os.environ.get("KVFLEET_TILE_FILE", "/tmp/kvfleet-decode-tile"), "w") as f:
            f.write(res["best_decode_tile"])
        print(f"best decode tile (BLOCK_N,warps,stages): {res['best_decode_tile']}")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"ceilings: copy {res['ceilings']['copy_bw_GBps']:.0f} GB/s, "
          f"bf16 matmul {res['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    for r in res["checks"]:
        print(f"  {'OK  ' if r['ok'] else 'FAIL'} {r['check']}: rel err {r['rel_err']:.2e} (tol {r['tol']})")
    for r in res["timings"]:
        extra = f"{r['GBps']:.0f} GB/s, {r['x_floor']:.2f}x floor" if "GBps" in r else f"{r['TFLOPs']:.0f} TFLOP/s"
        print(f"  {r['kernel']} [{r['config']}]: {r['ms']:.3f} ms, {extra}")
    return 0 if all(r["ok"] for r in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
