"""Issue 16's profile, first GPU call: where the losing rows' time goes. Usage:
    python bench/gpu_profile_issue16.py OUT_DIR [MODEL_DIR]      (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU, and a
                                                                  tiny random Llama unless MODEL_DIR is given)

Writes OUT_DIR/profile.json and OUT_DIR/profile.txt (tables), each section on its own so one failure leaves
the others:

1. ceilings: copy bandwidth, bf16 and FP8 (row-wise scaled) matmul rates at 8192^3.
2. prefill attention at long contexts (Llama heads 32/8, D 128, bf16; the long-prompt and shared-prefix
   classes): our Triton kernel at several tiles (KVFLEET_PREFILL_TILE candidates) against PyTorch's own flash
   SDPA on contiguous K/V (the FlashAttention-class reference); TFLOP/s and the error of each against a
   float32 reference. (A path through PyTorch's FA2 varlen kernel over gathered K/V was measured in the first
   lease, lost to our kernel, and was removed.)
3. FP8 linear on the GPU: `torch._scaled_mm` (row-wise) against the float32 reference of the same quantized
   operands at several M, and its time against bf16 `F.linear` at Llama-3.1-8B's four shapes.
4. the engine (Llama-3.1-8B, dummy weights): start-up split (load, KV sizing, graph capture), the warm-up
   (steps, seconds, Triton variants compiled) and the Triton compiles a varied workload still triggers after it
   (should be 0); the decode step at batch 1 (CUDA graph) against its weight-read floor, with an eager batch-1
   forward under torch.profiler (GEMV efficiency per kernel); one request of 1024/128 alone (TPOT as the engine
   sees it, no HTTP); one long-prompt step (2 x 8192 new tokens), one burst step (8 x 1024) and one mixed step
   (128 decodes + an 8192-token prefill chunk) under torch.profiler, kernel time by kind (bench/kernel_kinds.py);
   mixed-step time against the prefill chunk size (512, 2048, 8192 tokens beside 128 decodes): what a long
   prompt's chunk costs every running request's inter-token latency.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvfleet.engine.attention import build_attention_metadata, torch_paged_attention  # noqa: E402
from kvfleet.engine.bench.decode_probe import median_cuda_ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import GpuReport  # noqa: E402
from kernel_kinds import kernel_totals, ms_by_kind  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
RUN = GpuReport(on_cuda=DEV.type == "cuda")
BF16 = torch.bfloat16


def S(n: int) -> int:
    return max(1, n // 64) if DRY else n


def bench_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return median_cuda_ms(fn, iters)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


say, section = RUN.say, RUN.section


@section("ceilings")
def ceilings() -> dict[str, float]:
    from kvfleet.engine.bench.decode_probe import copy_bandwidth
    from kvfleet.engine.models.fp8 import quantize_per_row

    bw = copy_bandwidth(DEV, S(2**31)) if DEV.type == "cuda" else 0.0
    n = S(8192)
    a, b = torch.randn(n, n, dtype=BF16, device=DEV), torch.randn(n, n, dtype=BF16, device=DEV)
    bf16 = 2 * n**3 / (bench_ms(lambda: a @ b, 10) / 1e3)
    out = {"copy_bw_GBps": bw / 1e9, "bf16_matmul_TFLOPs": bf16 / 1e12}
    if DEV.type == "cuda":
        qa, sa = quantize_per_row(a)
        qb, sb = quantize_per_row(b)
        fp8 = 2 * n**3 / (bench_ms(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.reshape(1, -1),
                                                              out_dtype=BF16), 10) / 1e3)
        out["fp8_rowwise_matmul_TFLOPs"] = fp8 / 1e12
    say(" ".join(f"{k}={v:.0f}" for k, v in out.items()))
    return out


def _paged(q_lens: list[int], ctx: list[int], hq: int = 32, hkv: int = 8, d: int = 128,
           block_size: int = 16) -> dict[str, Any]:
    seq = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    nb = [math.ceil(s / block_size) for s in seq]
    perm = torch.randperm(sum(nb) + 4).tolist()
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n])
        i += n
    md = build_attention_metadata(q_lens, seq, tables, block_size, DEV)
    t = sum(q_lens)
    return {"md": md, "cache": torch.randn(2, sum(nb) + 4, block_size, hkv, d, device=DEV).to(BF16),
            "q": torch.randn(t, hq, d, device=DEV).to(BF16), "k": torch.randn(t, hkv, d, device=DEV).to(BF16),
            "v": torch.randn(t, hkv, d, device=DEV).to(BF16), "seq": seq, "q_lens": q_lens}


def _causal_flops(q_lens: list[int], seq: list[int], hq: int = 32, d: int = 128) -> float:
    # each query row i of a chunk sees ctx + i + 1 keys; QK^T and PV: 4 * D FLOPs per (row, key, head)
    return sum(4 * d * hq * sum(s - q + i + 1 for i in range(q)) for q, s in zip(q_lens, seq, strict=True))


@section("prefill attention at long contexts")
def prefill_attention_bench() -> list[dict[str, Any]]:
    from kvfleet.engine.kernels.prefill_attention import prefill_attention, prefill_work

    cases = [("1 x 8192 new", [S(8192)], [0]), ("2 x 4096 new", [S(4096)] * 2, [0, 0]),
             ("chunk 2048 over 6144 cached", [S(2048)], [S(6144)]),
             ("16 x 384 over 2048 cached (shared prefix)", [S(384)] * 16, [S(2048)] * 16)]
    tiles = [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3)]
    if DRY:   # the interpreter: check the script, not the kernel
        cases, tiles = [cases[0], cases[2]], tiles[:1]
    rows: list[dict[str, Any]] = []
    for name, q_lens, ctx in cases:
        c = _paged(q_lens, ctx)
        md, seq = c["md"], c["seq"]
        flops = _causal_flops(q_lens, seq)
        cache_ref = c["cache"].clone()
        ref = torch_paged_attention(c["q"].float(), c["k"].float(), c["v"].float(), cache_ref.float(), md,
                                    0.088) if sum(seq) <= S(20000) else None
        # our kernel's tiles (the cache already holds the new K/V after the op above wrote them)
        torch_paged_attention(c["q"], c["k"], c["v"], c["cache"], md, 0.088)
        for bm, bn, warps, stages in tiles:
            out = torch.full_like(c["q"], float("nan"))
            work = prefill_work(md.query_start_loc_cpu, bm, False, DEV)

            def run(bm: int = bm, bn: int = bn, warps: int = warps, stages: int = stages, work: Any = work,
                    out: torch.Tensor = out, c: dict[str, Any] = c, md: Any = md, mq: int = max(q_lens)) -> None:
                prefill_attention(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc,
                                  mq, 0.088, out, block_m=bm, block_n=bn, work=work,
                                  num_warps=warps, num_stages=stages)
            try:
                ms = bench_ms(run)
                err = rel_err(out, ref) if ref is not None else None
                rows.append({"case": name, "impl": f"triton {bm},{bn},{warps},{stages}", "ms": ms,
                             "TFLOPs": flops / (ms / 1e3) / 1e12, "rel_err": err})
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory)
                rows.append({"case": name, "impl": f"triton {bm},{bn},{warps},{stages}", "error": str(e)[:200]})
        if DEV.type == "cuda":
            # reference: PyTorch flash SDPA on contiguous K/V with GQA heads expanded (not counted)
            if all(x == 0 for x in ctx):
                b, L = len(q_lens), q_lens[0]
                q = c["q"].view(b, L, 32, 128).transpose(1, 2)
                k = c["k"].view(b, L, 8, 128).transpose(1, 2).repeat_interleave(4, dim=1)
                v = c["v"].view(b, L, 8, 128).transpose(1, 2).repeat_interleave(4, dim=1)
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ms = bench_ms(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                        scale=0.088))
                rows.append({"case": name, "impl": "torch SDPA flash, contiguous (reference)", "ms": ms,
                             "TFLOPs": flops / (ms / 1e3) / 1e12})
        del c
    for r in rows:
        say(f"{r['case']:45} {r['impl']:45} " + (f"{r['ms']:8.3f} ms {r['TFLOPs']:6.0f} TFLOP/s"
            + (f" err {r['rel_err']:.1e}" if r.get("rel_err") is not None else "") if "ms" in r
            else f"ERROR {r['error']}"))
    return rows


@section("fp8 linear")
def fp8_linear_bench() -> dict[str, Any]:
    from kvfleet.engine.kernels.fp8_quant import per_token_quant_fp8
    from kvfleet.engine.models.fp8 import fp8_linear_cuda, fp8_linear_reference, quantize_per_row

    if DEV.type != "cuda":
        return {"skipped": "no CUDA"}
    out: dict[str, Any] = {"checks": [], "timings": []}
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for m in (1, 7, 17, 256, 4096):
        n, k = shapes["qkv"]
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        w_q, w_s = quantize_per_row(torch.randn(n, k, device=DEV, dtype=BF16) * 0.02)
        err = rel_err(fp8_linear_cuda(x, w_q, w_s), fp8_linear_reference(x, w_q, w_s).float())
        q_fused, s_fused = per_token_quant_fp8(x)
        q_ref, s_ref = quantize_per_row(x)
        out["checks"].append({"M": m, "quant_scales_equal": bool(torch.equal(s_fused, s_ref)),
                              "quant_values_equal": bool(torch.equal(q_fused.float(), q_ref.float()))})
        say(f"fused per-token quant vs eager, M={m}: scales equal {torch.equal(s_fused, s_ref)}, "
            f"values equal {torch.equal(q_fused.float(), q_ref.float())}")
        out["checks"].append({"M": m, "rel_err_vs_reference": err, "ok": err < 2e-2})
        say(f"fp8 _scaled_mm vs float32 reference of the same operands, M={m}: rel err {err:.2e}")
    for m in (1, 16, 256, 8192):
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            w = torch.randn(n, k, device=DEV, dtype=BF16) * 0.02
            w_q, w_s = quantize_per_row(w)
            t_bf16 = bench_ms(lambda x=x, w=w: F.linear(x, w))
            t_fp8 = bench_ms(lambda x=x, w_q=w_q, w_s=w_s: fp8_linear_cuda(x, w_q, w_s))
            # the activation's quantization alone: eager PyTorch ops (the first version) against the fused kernel
            t_q_eager = bench_ms(lambda x=x: quantize_per_row(x))
            t_q_fused = bench_ms(lambda x=x: per_token_quant_fp8(x))
            row = {"M": m, "layer": name, "bf16_ms": t_bf16, "fp8_ms": t_fp8, "speedup": t_bf16 / t_fp8,
                   "quant_eager_ms": t_q_eager, "quant_fused_ms": t_q_fused}
            out["timings"].append(row)
            say(f"M={m:5} {name:8} bf16 {t_bf16:.4f} ms  fp8 (incl. per-token quant) {t_fp8:.4f} ms  "
                f"x{t_bf16 / t_fp8:.2f}  (quant alone: eager {t_q_eager:.4f} ms, fused {t_q_fused:.4f} ms)")
    return out


def _profiled(fn: Callable[[], Any], label: str, rows: int = 15) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if DEV.type == "cuda" else "self_cpu_time_total"
    say(f"--- {label}")
    say(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))
    groups = ms_by_kind(kernel_totals(prof, on_device=True)) if DEV.type == "cuda" else {}
    if groups:
        say("device ms by kind: " + ", ".join(f"{k} {v:.2f}" for k, v in groups.items() if v))
    return {"groups_ms": groups}


@section("engine")
def engine_profile() -> dict[str, Any]:
    from kvfleet.engine.bench.decode_probe import probe_decode_step
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.engine.sampling_params import SamplingParams
    from kvfleet.engine.warmup import TRITON_COMPILES

    if len(sys.argv) > 2:
        model = sys.argv[2]
    elif DRY:   # Llama-3.1-8B's 16 GB of dummy weights do not fit a CPU box's memory beside the interpreter
        from kvfleet.engine.testing import make_tiny_model
        model = str(make_tiny_model("llama", Path(os.environ.get("TMPDIR", "/tmp")) / "kvfleet-profile-dry"))
    else:
        model = "bench/models/llama-3.1-8b"
    res: dict[str, Any] = {}
    TRITON_COMPILES.install()
    t0 = time.monotonic()
    cfg = EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device=DEV.type,
                       max_model_len=S(8192) + S(512) + 64, max_num_seqs=S(1024) if not DRY else 32,
                       max_num_batched_tokens=S(16384), num_kv_blocks=4096 if DRY else None)
    eng = LLMEngine(cfg)
    res["engine_init_s"] = time.monotonic() - t0
    res["compiles_during_init"] = TRITON_COMPILES.count
    w = eng.warm_up()
    res["warmup"] = {"requests": w.requests, "steps": w.steps, "seconds": w.seconds, "compiles": w.triton_compiles}
    say(f"engine init {res['engine_init_s']:.1f} s ({res['compiles_during_init']} Triton variants compiled), "
        f"warm-up {w.seconds:.2f} s, {w.steps} steps, {w.triton_compiles} variants compiled")
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, min(vocab, 32000), (n,), generator=g).tolist()

    # a varied workload after the warm-up: any compile now would be paid by a live request
    before = TRITON_COMPILES.count
    for i, n in enumerate([1, 3, 15, 16, 17, 100, 1023, 1024, 1025, 3000]):
        eng.add_request(f"v{i}", {"prompt_token_ids": ids(S(n) if n > 64 else n)},
                        SamplingParams(max_tokens=4 + i, temperature=0.0 if i % 2 else 0.8, ignore_eos=True))
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    res["compiles_after_warmup"] = TRITON_COMPILES.count - before
    say(f"Triton variants compiled by a varied workload after the warm-up: {res['compiles_after_warmup']}")
    eng.kv.reset_prefix_cache()

    # batch-1 decode: CUDA graph step against the weight-read floor, and an eager forward's kernels
    if DEV.type == "cuda":
        res["decode_probe_b1"] = probe_decode_step(eng, 1, 1024)
        res["decode_probe_b64"] = probe_decode_step(eng, 64, 1024)
        p = res["decode_probe_b1"]
        say(f"decode B=1 ctx 1024: graph {p.get('step_ms', float('nan')):.3f} ms, eager "
            f"{p.get('eager_step_ms', float('nan')):.3f} ms, floor {p.get('floor_ms', float('nan')):.3f} ms -> "
            f"{p.get('x_floor', float('nan')):.2f}x")
        runner = eng.runner
        md = build_attention_metadata([1], [1024], [list(range(64))], runner.block_size, DEV)
        x_ids, pos = torch.tensor([5], device=DEV), torch.tensor([1023], device=DEV)
        with torch.inference_mode():
            for _ in range(3):
                runner.executor.model(x_ids, pos, runner.kv_caches, md)
            res["eager_b1_forward"] = _profiled(lambda: runner.executor.model(x_ids, pos, runner.kv_caches, md),
                                                "eager batch-1 forward (per kernel)")

    # one request alone: TPOT as the engine delivers it (host + device per token, no HTTP)
    eng.add_request("solo", {"prompt_token_ids": ids(S(1024))},
                    SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    m = done[0].metrics
    res["solo_ttft_ms"] = 1e3 * (m.first_token_time - m.arrival_time)
    res["solo_tpot_ms"] = 1e3 * (m.finished_time - m.first_token_time) / 127
    say(f"one 1024/128 request alone: TTFT {res['solo_ttft_ms']:.1f} ms, TPOT {res['solo_tpot_ms']:.3f} ms")
    eng.kv.reset_prefix_cache()

    def prefill_step(name: str, prompts: int, tokens: int) -> dict[str, Any]:
        """One step prefilling `prompts` fresh prompts of `tokens` tokens, under torch.profiler; then drained."""
        for i in range(prompts):
            eng.add_request(f"{name}{i}", {"prompt_token_ids": ids(S(tokens))},
                            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        with torch.inference_mode():
            prof = _profiled(eng.step, f"one step: {prompts} x {tokens}-token prefill")
        while eng.has_unfinished_requests():
            eng.step()
        eng.kv.reset_prefix_cache()
        return prof

    # the long-prompt class's prefill; then a burst's (online, 8,192 batched tokens: the 300-at-once row, whose
    # TTFT is the one online figure under vLLM's on an H100; attention is ~2 % of its FLOPs, the GEMMs the rest)
    res["long_prefill_step"] = prefill_step("long", 2, 8192)
    res["burst_prefill_step"] = prefill_step("burst", 8, 1024)

    # mixed steps: 128 decoding requests, then a prompt whose chunk is 512 / 2048 / 8192 tokens
    chunk_rows = []
    budget = eng.scheduler.max_num_batched_tokens

    def sync() -> None:
        if DEV.type == "cuda":
            torch.cuda.synchronize()

    for chunk in (512, 2048, 8192):
        eng.scheduler.max_num_batched_tokens = budget
        for i in range(S(128)):
            eng.add_request(f"d{chunk}-{i}", {"prompt_token_ids": ids(S(256))},
                            SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        while eng.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                           for r in eng.scheduler.running):
            eng.step()   # until every request decodes
        eng.scheduler.max_num_batched_tokens = S(chunk) + S(128)
        for _ in range(2):
            eng.step()
        sync()
        t = time.perf_counter()
        for _ in range(5):
            eng.step()
        sync()
        decode_ms = (time.perf_counter() - t) / 5 * 1e3
        eng.add_request(f"p{chunk}", {"prompt_token_ids": ids(S(8192) + 64)},
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        if chunk == 8192:
            with torch.inference_mode():
                res["mixed_step_profile"] = _profiled(eng.step, "one mixed step: 128 decodes + 8192-token chunk")
        else:
            eng.step()
        sync()
        t = time.perf_counter()
        steps = 3 if chunk < 8192 else 1   # the 8192-token chunk is one step (its remainder follows)
        for _ in range(steps):
            eng.step()
        sync()
        mixed_ms = (time.perf_counter() - t) / steps * 1e3
        chunk_rows.append({"chunk": chunk, "decode_step_ms": decode_ms, "mixed_step_ms": mixed_ms})
        say(f"{S(128)} decodes: {decode_ms:.2f} ms per step; with a {S(chunk)}-token prefill chunk beside them: "
            f"{mixed_ms:.2f} ms per step")
        eng.abort_request(list(eng.groups))
        while eng.has_unfinished_requests():
            eng.step()
        eng.kv.reset_prefix_cache()
    eng.scheduler.max_num_batched_tokens = budget
    res["chunk_cost"] = chunk_rows
    eng.shutdown()
    return res


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "profile-out")
    out.mkdir(parents=True, exist_ok=True)
    # PROFILE_SECTIONS=fp8,engine runs only the sections whose function names contain one of these words
    only = [w for w in os.environ.get("PROFILE_SECTIONS", "").split(",") if w]
    for fn in (ceilings, prefill_attention_bench, fp8_linear_bench, engine_profile):
        if not only or any(w in fn.__name__ for w in only):
            fn()
    RUN.write(out, "profile")
    failed = RUN.failed()
    print(f"profile written to {out}; failed sections: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
