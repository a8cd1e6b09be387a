"""Prefill attention on the GPU (issue 16, long-prompt row): kernel v1 against v2 at several tiles, and PyTorch's
flash SDPA on contiguous K/V as the FlashAttention-class reference. Usage:
    python bench/gpu_attention_sweep.py OUT_DIR          (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU, interpreted)

Llama-3.1-8B's attention (32 query heads, 8 KV heads, D 128), bf16, paged cache of 16-token blocks in shuffled
physical order. Cases: 1 x 8192, 2 x 4096, 8 x 2048 fresh prompts; a 2048-token chunk over 6144 cached tokens;
16 x 384 new tokens over 2048 cached each (the shared-prefix row). Each implementation: ms per call in a CUDA graph
(CUDA events; eager, and marked so, where it does not capture: an eager call's figure holds its wrapper's host time),
TFLOP/s of the causal work (4 D FLOPs per visible (query, key, head)), and its error against a float32
reference computed from the same bf16 cache (max abs and relative Frobenius). One failing configuration (a tile
that does not compile, say) is recorded as an error and the sweep goes on. Writes OUT_DIR/attention_sweep.json
(after every case, so a crash leaves what ran) and OUT_DIR/attention_sweep.txt.

SWEEP_CASES (a regular expression over the case names) picks other cases, among them 8 x 1024, 16 x 1024 and
4 x 512 fresh prompts (the 1k-token prompts of a burst and of random-1024-128); SWEEP_TMA_TILES="BM,BN,W,S ..."
sweeps fresh prompts at those tiles only, on the engine's path for them (K/V by TMA), beside torch's flash.

Implementations (`impl` in the results):
  v1 BM,BN,W,S             the first kernel (`prefill_attention`; KVFLEET_PREFILL_KERNEL=v1, the default: 64,64,4,2)
  v2 BM,BN,W,S             `prefill_attention_v2` with its heaviest-first work list, every key through the block
                           table (KVFLEET_PREFILL_KERNEL=v2-paged; also what v2 does for chunks over a prefix)
  v2 ... grid order        v2 without a work list (the grid itself runs the last query tiles first)
  v2 ... unsorted work     v2 with v1's work order: isolates the heaviest-first order
  v2 ... contiguous kv tma v2 given the step's k/v: the new tokens' K/V tiles come from the contiguous
                           projections by TMA, a cached prefix's through the block table
                           (KVFLEET_PREFILL_KERNEL=v2 on Hopper)
                           (with SWEEP_BLOCK_SIZE of 64 and more, the cached keys by TMA too, a tile a block)
  v2 ... cache gathered    the same with the cached keys gathered row by row through the block table
  v2 ..., cache +N stages  the loop over cached keys pipelined N stages deeper than the tile's num_stages
                           (KVFLEET_PREFILL_CACHE_EXTRA_STAGES=N; at +2 its K/V tiles get the three buffers and
                           two-tile lead the loops over new keys have: sm_90 TTGIR)
  v2 ... contiguous kv     the same with pointer loads (what v2 does where TMA does not apply)
  torch SDPA flash         F.scaled_dot_product_attention, flash backend, contiguous K/V with the KV heads
                           expanded (not counted), causal aligned to the last key
  gluon fa3-style BM,BN,W,B  the Gluon prototype (`prefill_attention_gluon`: FlashAttention-3's order of async wgmmas,
                           K/V by TMA into B buffers) on the step's k/v; fresh prompts only, not in the dry run
                           (Gluon kernels have no interpreter)
  gluon paged fa3[-ws] ... its paged form (`prefill_attention_gluon_paged`, what KVFLEET_PREFILL_KERNEL=gluon-chunks
                           runs on chunks over a cached prefix): every key from the paged cache, one TMA copy a
                           block into the key tile; -ws: a producer warp issues them (the engine's); every case;
  gluon paged ahead-ws ... the same in the S-ahead schedule at 128 x 64 (ptxas keeps every exponential of its
                           unmasked loop under an MMA there, `bench/gluon_attention_resources.py`)
  gluon [paged] fa3-pp ... two consumer warpgroups of 64 query rows and a producer warp, the warpgroups issuing
                           their MMAs in turns (FlashAttention-3's ping-pong: KVFLEET_GLUON_SCHEDULE=pingpong)
  gluon [paged] fa3-ws2 .. the same without the turns (KVFLEET_GLUON_SCHEDULE=two-warpgroups); both last
  gluon paged fa3-ws2 at-once  the same, its producer loading a tile's block numbers in one load
                           (KVFLEET_GLUON_PAGE_LOADS=per-tile), the very last
  vLLM FA3 paged           vLLM's FlashAttention-3 (`vllm.vllm_flash_attn.flash_attn_varlen_func`, fa_version 3)
                           over the same paged cache and block tables, as vLLM's engine calls it on Hopper: the
                           target for our kernel (only where vLLM's wheels are installed, PYTHONPATH=/tmp/site)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvfleet.engine.attention import build_attention_metadata  # noqa: E402
from kvfleet.engine.attention.triton_backend import prefill_tile  # noqa: E402
from kvfleet.engine.bench.decode_probe import ms_per_call  # noqa: E402
from kvfleet.engine.kernels import reshape_and_cache  # noqa: E402
from kvfleet.engine.kernels.prefill_attention import prefill_attention, prefill_work  # noqa: E402
from kvfleet.engine.kernels.prefill_attention_v2 import default_tile_v2, prefill_attention_v2  # noqa: E402

from provenance import git_describe  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
BF16 = torch.bfloat16
HQ, HKV, D = 32, 8, 128
# SWEEP_BLOCK_SIZE: the cache's block size (16, the engine's default; from 64 on, a chunk's cached keys come a
# key tile at a time by TMA: `cache_tma_applies`)
BLOCK_SIZE = int(os.environ.get("SWEEP_BLOCK_SIZE", "16"))
SCALE = D ** -0.5
# configurations past the budget are skipped, not cut (compare_vllm.sh's sweeps stage kills the run at 150 s);
# each case may spend up to its share of it (the first more: every kernel variant compiles there)
BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", "900" if DRY else "105"))
CASE_SHARES = [0.4, 0.15, 0.15, 0.15, 0.15]

# 128-row tiles with 4 warps spill registers on sm_90 (bench/prefill_kernel_resources.py); 8 warps do not
V1_TILES = [(64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3)]
V2_TILES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
            (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3)]
V2_DEFAULT = default_tile_v2(8192, BF16)   # KVFLEET_PREFILL_KERNEL=v2 at long chunks
V2_TMA_TILES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3)]
# the Gluon prototype's default: (BLOCK_M, BLOCK_N, num_warps, K/V buffers)
GLUON_TILE = (128, 128, 8, 2)
GLUON_AHEAD_TILE = (128, 64, 8, 2)   # the S-ahead schedule's tile (two score tiles live: 128 keys spill)


def S(n: int) -> int:
    """Problem sizes: real on the GPU, divided by 128 in a dry run."""
    return max(1, n // 128) if DRY else n


ALL_CASES: list[tuple[str, list[int], list[int]]] = [
    ("1 x 8192 new", [S(8192)], [0]),
    ("2 x 4096 new", [S(4096)] * 2, [0, 0]),
    ("8 x 2048 new", [S(2048)] * 8, [0] * 8),
    ("chunk 2048 over 6144 cached", [S(2048)], [S(6144)]),
    ("16 x 384 over 2048 cached (shared prefix)", [S(384)] * 16, [S(2048)] * 16),
    # 1k-token prompts: a burst's and random-1024-128's prefill steps (8 online, 16 offline)
    ("8 x 1024 new", [S(1024)] * 8, [0] * 8),
    ("16 x 1024 new", [S(1024)] * 16, [0] * 16),
    ("4 x 512 new", [S(512)] * 4, [0] * 4),
]
# SWEEP_CASES: a regular expression picking cases by name (default: the first five, lease 3's set)
_PICK = os.environ.get("SWEEP_CASES", "")
CASES = [c for c in ALL_CASES if re.search(_PICK, c[0])] if _PICK else ALL_CASES[:5]
if not CASES:
    sys.exit(f"SWEEP_CASES={_PICK!r} matches no case of {[c[0] for c in ALL_CASES]}")
if _PICK:
    CASE_SHARES = [1.0 / len(CASES)] * len(CASES)


# SWEEP_TMA_TILES="BM,BN,W,S BM,BN,W,S ...": the tiles fresh prompts are swept at (with TMA), and only those
TMA_ONLY = [t for t in (prefill_tile(raw, "SWEEP_TMA_TILES") for raw in os.environ.get("SWEEP_TMA_TILES", "").split())
            if t is not None]


GRAPH_CALLS = 4   # calls a timing graph holds


def graph_ms(fn: Callable[[], Any], iters: int = 20) -> tuple[float, bool]:
    """(ms per call, whether in a CUDA graph): timed in a graph where it captures, so the figure is the kernel's
    and not the wrapper's host time too (an eager call after a sync waits for its own launch: lease 24)."""
    return ms_per_call([fn] * GRAPH_CALLS, DEV, iters)


def causal_flops(q_lens: list[int], ctx: list[int]) -> float:
    # query row i of a chunk after c cached tokens sees c + i + 1 keys; QK^T and PV: 4 D FLOPs per (row, key, head)
    return float(sum(4 * D * HQ * (q * c + q * (q + 1) // 2) for q, c in zip(q_lens, ctx, strict=True)))


def build_case(q_lens: list[int], ctx: list[int], gen: torch.Generator) -> dict[str, Any]:
    """A paged cache in shuffled blocks holding random cached prefixes, the new tokens' K/V written into it."""
    seq = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    nb = [math.ceil(s / BLOCK_SIZE) for s in seq]
    perm = torch.randperm(sum(nb) + 4, generator=gen).tolist()
    tables, i = [], 0
    for n in nb:
        tables.append(perm[i:i + n])
        i += n
    md = build_attention_metadata(q_lens, seq, tables, BLOCK_SIZE, DEV)
    t = sum(q_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(BF16).to(DEV)

    # k and v as views of one fused qkv projection, as the model's split hands them over
    qkv = randn(t, HQ + 2 * HKV, D)
    q, k, v = qkv[:, :HQ].contiguous(), qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    cache = randn(2, sum(nb) + 4, BLOCK_SIZE, HKV, D)
    reshape_and_cache(k, v, cache, md.slot_mapping)
    return {"md": md, "q": q, "k": k, "v": v, "cache": cache, "seq": seq, "q_lens": q_lens, "ctx": ctx,
            "tables": tables}


def gathered_kv(c: dict[str, Any], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values [S, Hkv, D] read out of the paged cache."""
    blocks = torch.tensor(c["tables"][b], device=DEV)
    s = c["seq"][b]
    return (c["cache"][0, blocks].reshape(-1, HKV, D)[:s], c["cache"][1, blocks].reshape(-1, HKV, D)[:s])


def reference(c: dict[str, Any]) -> torch.Tensor:
    """float32 causal attention (aligned to the last key) from the bf16 cache, 8 heads at a time."""
    out = torch.empty(c["q"].shape, dtype=torch.float32, device=DEV)
    qsl = c["md"].query_start_loc_cpu
    g = HQ // HKV
    for b, (q_len, ctx) in enumerate(zip(c["q_lens"], c["ctx"], strict=True)):
        k, v = (x.float().repeat_interleave(g, dim=1).transpose(0, 1) for x in gathered_kv(c, b))   # [Hq, S, D]
        q = c["q"][qsl[b]:qsl[b + 1]].float().transpose(0, 1)                                       # [Hq, q, D]
        visible = (torch.arange(k.shape[1], device=DEV)[None, :]
                   <= ctx + torch.arange(q_len, device=DEV)[:, None])
        for h0 in range(0, HQ, 8):
            s = (q[h0:h0 + 8] @ k[h0:h0 + 8].transpose(1, 2)) * SCALE
            p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
            out[qsl[b]:qsl[b + 1], h0:h0 + 8] = (p @ v[h0:h0 + 8]).transpose(0, 1)
            del s, p
    return out


def sdpa_runner(c: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """PyTorch flash SDPA on contiguous K/V (every sequence of a case has the same lengths: one batch)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    n, q_len, s = len(c["q_lens"]), c["q_lens"][0], c["seq"][0]
    q = c["q"].view(n, q_len, HQ, D).transpose(1, 2)
    kv = [gathered_kv(c, b) for b in range(n)]
    k = torch.stack([x[0] for x in kv]).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1).contiguous()
    v = torch.stack([x[1] for x in kv]).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1).contiguous()
    result: list[torch.Tensor] = []

    backend = SDPBackend.FLASH_ATTENTION if DEV.type == "cuda" else SDPBackend.MATH   # the dry run: its shapes

    def run() -> None:
        with sdpa_kernel(backend):
            if s == q_len:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, s), scale=SCALE)
        result[:] = [o]

    return run, lambda: result[0].transpose(1, 2).reshape(-1, HQ, D)


def fa3_available() -> bool:
    """vLLM's FlashAttention-3 can run here (its wheels installed, a Hopper GPU)."""
    if DEV.type != "cuda":
        return False
    try:
        from vllm.vllm_flash_attn import is_fa_version_supported
    except ImportError:
        return False
    return bool(is_fa_version_supported(3))


def fa3_runner(c: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """vLLM's FA3 on the paged cache: block tables, per-sequence key counts, causal aligned to the last key."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    md = c["md"]
    out = torch.full_like(c["q"], float("nan"))

    def run() -> None:
        flash_attn_varlen_func(c["q"], c["cache"][0], c["cache"][1], max(c["q_lens"]), md.query_start_loc,
                               max(c["seq"]), seqused_k=md.seq_lens, softmax_scale=SCALE, causal=True,
                               block_table=md.block_tables, out=out, fa_version=3)
    return run, lambda: out


REFERENCES = {"torch SDPA flash": sdpa_runner, "vLLM FA3 paged": fa3_runner}


def kernel_runner(c: dict[str, Any], impl: str, tile: tuple[int, int, int, int],
                  ) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    md, q_lens = c["md"], c["q_lens"]
    bm, bn, warps, stages = tile
    out = torch.full_like(c["q"], float("nan"))
    common = (c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc, max(q_lens), SCALE, out)
    qsl = md.query_start_loc_cpu
    if impl.startswith("gluon paged"):
        return gluon_paged_runner(c, tile, out, impl.removeprefix("gluon paged "))
    if impl.startswith("gluon"):
        return gluon_runner(c, tile, out, impl.removeprefix("gluon ").removesuffix("-style"))
    if impl == "v1":
        work = prefill_work(qsl, bm, False, DEV)

        def run() -> None:
            prefill_attention(*common, block_m=bm, block_n=bn, work=work, num_warps=warps, num_stages=stages)
    else:
        grid_order, unsorted, contig = "grid order" in impl, "unsorted" in impl, "contiguous" in impl
        work2 = None if grid_order else prefill_work(qsl, bm, False, DEV, None if unsorted else md.seq_lens_cpu)
        kv: dict[str, Any] = {"k": c["k"], "v": c["v"], "kv_tma": "kv tma" in impl} if contig else {}
        if "cache gathered" in impl:
            kv["cache_tma"] = False
        deeper = re.search(r"cache \+(\d) stages", impl)
        if deeper:
            kv["cache_stages"] = stages + int(deeper.group(1))

        def run() -> None:
            prefill_attention_v2(*common, block_m=bm, block_n=bn, work=work2, num_warps=warps,
                                 num_stages=stages, **kv)
    return run, lambda: out


def gluon_runner(c: dict[str, Any], tile: tuple[int, int, int, int], out: torch.Tensor, schedule: str,
                 ) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """The Gluon prototype on the step's k/v (fresh prompts only) in a `named_tile` schedule; imported here, so
    that a Triton without Gluon fails this row only."""
    from kvfleet.engine.kernels.prefill_attention_gluon import named_tile, prefill_attention_gluon

    if any(c["ctx"]):
        raise ValueError("the Gluon kernel serves fresh prompts only (no cached prefix)")
    md, q_lens = c["md"], c["q_lens"]
    bm, bn, warps, buffers = tile
    g = named_tile(schedule, bm, bn, buffers, warps)
    work = prefill_work(md.query_start_loc_cpu, bm, False, DEV, md.seq_lens_cpu)

    def run() -> None:
        prefill_attention_gluon(c["q"], c["k"], c["v"], md.query_start_loc, max(q_lens), SCALE, out, work=work,
                                **dataclasses.asdict(g))
    return run, lambda: out


def gluon_paged_runner(c: dict[str, Any], tile: tuple[int, int, int, int], out: torch.Tensor, schedule: str,
                       ) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """The Gluon kernel's paged form: every key of each sequence from the cache (the new tokens' written there)."""
    from kvfleet.engine.kernels.prefill_attention_gluon import named_tile, prefill_attention_gluon_paged

    md, q_lens = c["md"], c["q_lens"]
    bm, bn, warps, buffers = tile
    name, _, at_once = schedule.partition(" ")   # "fa3-ws2 at-once": the block numbers of a tile in one load
    g = dataclasses.replace(named_tile(name, bm, bn, buffers, warps), pages_at_once=at_once == "at-once")
    work = prefill_work(md.query_start_loc_cpu, bm, False, DEV, md.seq_lens_cpu)

    def run() -> None:
        prefill_attention_gluon_paged(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc,
                                      max(q_lens), SCALE, out, work=work, **dataclasses.asdict(g))
    return run, lambda: out


def gluon_rows(fresh: bool) -> list[tuple[str, tuple[int, int, int, int] | None]]:
    """The Gluon rows, never in the dry run (no interpreter for Gluon): on the step's k/v for fresh prompts (it reads
    no cache there), its paged form (the engine's, warp-specialized, first) for every case."""
    if DRY:
        return []
    fresh_row = [("gluon fa3-style", GLUON_TILE)] if fresh else []
    # the two-consumer variants last (never run before: a deadlock there loses only what comes after it)
    two = [("gluon fa3-pp", GLUON_TILE), ("gluon fa3-ws2", GLUON_TILE)] if fresh else []
    return fresh_row + [("gluon paged fa3-ws", GLUON_TILE), ("gluon paged ahead-ws", GLUON_AHEAD_TILE),
                        ("gluon paged fa3", GLUON_TILE)] + two + [("gluon paged fa3-pp", GLUON_TILE),
                                                                  ("gluon paged fa3-ws2", GLUON_TILE),
                                                                  ("gluon paged fa3-ws2 at-once", GLUON_TILE)]


def configs(fresh: bool, fa3: bool = False) -> list[tuple[str, tuple[int, int, int, int] | None]]:
    """A case's configurations, most wanted first (a case out of time skips the rest); `fa3`: vLLM's FA3 too."""
    if fa3:
        return [("vLLM FA3 paged", None)] + configs(fresh)
    if TMA_ONLY:   # the engine's path at each tile asked for (and, for cached keys, the same gathered row by row)
        out = [("v2 contiguous kv tma", t) for t in TMA_ONLY]
        if not fresh:
            out += [("v2 contiguous kv tma, cache +2 stages", t) for t in TMA_ONLY]
        if not fresh and BLOCK_SIZE > 16:
            out += [("v2 contiguous kv tma, cache gathered", t) for t in TMA_ONLY]
            out += [("v2 contiguous kv tma, cache gathered, cache +2 stages", t) for t in TMA_ONLY]
        return out + [("torch SDPA flash", None)] + gluon_rows(fresh)
    if DRY:   # the interpreter: check the script end to end, one configuration of each kind
        out: list[tuple[str, tuple[int, int, int, int] | None]] = [
            ("v1", V1_TILES[0]), ("torch SDPA flash", None), ("v2", V2_DEFAULT), ("v2 grid order", V2_DEFAULT)]
        out += [("v2 contiguous kv", V2_DEFAULT), ("v2 contiguous kv tma", V2_DEFAULT)]
        return out + ([] if fresh else [("v2 contiguous kv tma, cache +2 stages", V2_DEFAULT)])
    tma = [("v2 contiguous kv tma", t) for t in (V2_TMA_TILES if fresh else V2_TMA_TILES[:2])]
    deeper = [] if fresh else [("v2 contiguous kv tma, cache +2 stages", V2_DEFAULT),
                               ("v2, cache +2 stages", V2_DEFAULT)]
    out = [("v1", V1_TILES[0]), ("v2", V2_DEFAULT)] + tma[:1] + deeper + [("torch SDPA flash", None)]
    out += [("v1", t) for t in V1_TILES[1:]] + [("v2", t) for t in V2_TILES if t != V2_DEFAULT] + tma[1:]
    out += [("v2 grid order", V2_DEFAULT), ("v2 unsorted work", V2_DEFAULT)]
    # the untried Gluon prototype last: a hang (a wrong mbarrier phase) would cost only the rows after it
    return out + [("v2 contiguous kv", V2_DEFAULT)] + gluon_rows(fresh)


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return {"max_abs_err": float("nan"), "rel_err": float("nan")}
    return {"max_abs_err": float((g - r).abs().max()), "rel_err": float((g - r).norm() / r.norm().clamp_min(1e-30))}


def fmt(r: dict[str, Any]) -> str:
    head = f"{r['case']:42} {r['impl']:56}"
    if "ms" not in r:
        return f"{head} {r.get('error') or r.get('skipped')}"
    eager = "" if r.get("graph", True) else " (eager)"
    return (f"{head} {r['ms']:9.3f} ms {r['TFLOPs']:6.1f} TFLOP/s  max abs err {r.get('max_abs_err', float('nan')):.2e}"
            f"  rel {r.get('rel_err', float('nan')):.2e}{eager}")


def write(out_dir: Path, report: dict[str, Any], header: list[str]) -> str:
    """attention_sweep.json and attention_sweep.txt (every row, then the best of each kernel per case)."""
    rows = report["rows"]
    lines = header + [fmt(r) for r in rows]
    lines.append("\nbest per case (TFLOP/s):")
    for name, _, _ in CASES:
        timed = [r for r in rows if r["case"] == name and "ms" in r]
        best = {k: max((r for r in timed if r["kernel"].startswith(k)), key=lambda r: r["TFLOPs"], default=None)
                for k in ("v1", "v2", "gluon", "torch", "vLLM")}
        lines.append(f"  {name:42} " + "  ".join(f"{k}: {r['impl']} {r['TFLOPs']:.0f}" for k, r in best.items()
                                                   if r is not None))
    failed = [r for r in rows if "error" in r]
    lines.append(f"\n{len(rows)} rows, {len(failed)} failed, {report['seconds']:.0f} s")
    text = "\n".join(lines) + "\n"
    (out_dir / "attention_sweep.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "attention_sweep.txt").write_text(text)
    return text


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "attention-sweep-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"git": git_describe(), "dry_run": DRY, "device": str(DEV),
                              "gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else None,
                              "torch": torch.__version__, "heads": [HQ, HKV, D], "block_size": BLOCK_SIZE,
                              "rows": []}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:   # pragma: no cover - triton ships with torch on Linux
        pass
    rows: list[dict[str, Any]] = report["rows"]
    lines = [f"prefill attention sweep ({report.get('gpu') or 'CPU interpreter, dry run'}, Hq {HQ} Hkv {HKV} D {D},"
             f" bf16, block {BLOCK_SIZE}); {report['git']}"]
    print(lines[0], flush=True)
    fa3 = fa3_available()
    report["vllm_fa3"] = fa3
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(16)
    for i, (name, q_lens, ctx) in enumerate(CASES):
        fresh = all(x == 0 for x in ctx)
        deadline = t0 + BUDGET_S * sum(CASE_SHARES[:i + 1])
        try:
            c = build_case(q_lens, ctx, gen)
            ref = reference(c)
        except Exception as e:  # noqa: BLE001 - the next case still runs
            rows.append({"case": name, "impl": "setup", "error": f"{type(e).__name__}: {e}"[:300]})
            print(fmt(rows[-1]), flush=True)
            continue
        flops = causal_flops(q_lens, ctx)
        for impl, tile in configs(fresh, fa3):
            label = impl if tile is None else impl.replace("v2", f"v2 {','.join(map(str, tile))}", 1).replace(
                "v1", f"v1 {','.join(map(str, tile))}", 1).replace("gluon", f"gluon {','.join(map(str, tile))}", 1)
            row: dict[str, Any] = {"case": name, "impl": label, "kernel": impl, "tile": tile, "q_lens": q_lens,
                                   "ctx": ctx, "flops": flops}
            if time.monotonic() > deadline:
                row["skipped"] = f"this case's share of the {BUDGET_S:.0f} s budget spent"
            else:
                try:
                    t = time.monotonic()
                    run, result = REFERENCES[impl](c) if tile is None else kernel_runner(c, impl, tile)
                    run()   # compiles (first use of a tile) and checks before timing
                    row.update(errors(result(), ref))
                    row["first_call_s"] = time.monotonic() - t
                    # the interpreter's time says nothing: its one run is the dry run's check
                    row["ms"], row["graph"] = (row["first_call_s"] * 1e3, False) if DRY else graph_ms(run)
                    row["TFLOPs"] = flops / (row["ms"] / 1e3) / 1e12
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory), say
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(fmt(row), flush=True)
        del c, ref
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        report["seconds"] = time.monotonic() - t0
        write(out_dir, report, lines)   # after every case: a run cut short leaves what it measured
    report["seconds"] = time.monotonic() - t0
    text = write(out_dir, report, lines)
    print(text[text.index("\nbest per case (TFLOP/s):"):], flush=True)
    print(f"written to {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
