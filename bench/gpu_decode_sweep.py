"""Decode attention's tile at the batches of a loaded server, against the bytes it must read (one call). Usage:
    python bench/gpu_decode_sweep.py OUT_DIR      (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU under the interpreter)

Writes OUT_DIR/decode_sweep.json and OUT_DIR/decode_sweep.txt.

Why: at 3 stages (the default, `KVFLEET_DECODE_TILE=64,4,3`) Triton's pipeliner gives the block-table load a stage of
its own and keeps one K and one V tile in shared memory: the next tile's copy starts after the tile before it is
used, so within a program no copy is in flight during the math (`bench/decode_kernel_resources.py`, `kv_buffers`).
The first kernel round swept only 2 and 3 stages (1.20x the copy floor at B=256, ctx 1024, on the H200). 5 stages
at 64 keys, or 6 at 32, keep two tiles. In the 300-at-once row up to ~300 decodes of ~1k keys share every mixed
step with prefills, so this kernel is a candidate for the ~4 % its steps lose to vLLM's.

The long-prompt row's decode steps matter as much: lease 19's run spent 230 of them at 22.4 ms (a quarter of its
20.4 s), at a mean batch of 46 over ~6.2k keys: 368 programs of one split for 132 SMs, each reading its 6k keys
one tile at a time.

Cases: Llama-3.1-8B heads (32 query, 8 KV, D 128, bf16, 16-token blocks, blocks scattered) at B = 256, 64 and 16
with 1,024 keys, 48 x 6,144 (the long-prompt row), 128 x 4,096, Qwen3-0.6B's 16 query heads at B = 256, and 12 and 4
x 6,144 (the long-prompts profile's decode steps and a mixed step's few decodes: lease 25's profile put our decode
kernel at 145 ms against FA3's 95 there, in 3 splits, level at 48 x 6k in one; `KVFLEET_DECODE_PROGRAMS_PER_SM`
moves the count); the engine's split count for each (`choose_num_splits`), and from 4,096 keys also two splits (what
`KVFLEET_DECODE_LONG_SPLIT=2048` gives); the default tile also at 1, 2, 4, 6, 8 and 16 splits (of 128 keys or more):
which split count each batch wants, beside FA3's own choice. Each: the error against the float32 reference
(NaN-poisoned output first), then the time per call in a CUDA graph (as the engine's decode steps run: lease 24's
eager timing put the wrapper's host time inside every figure, most of it at B=16), over copies of the case whose
caches together exceed three times the L2 cache (a call does not find the previous one's keys there), GB/s of K/V
read and the time over the copy floor (measured copy bandwidth). Where vLLM's wheels are installed, its
FlashAttention-3 on the same paged cache (its own split heuristic) is a row of each case: the target. A tile worth
trying end to end: `KVFLEET_DECODE_TILE=<tile>` in the online or offline A/B stages.
"""

from __future__ import annotations

import functools
import json
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

from kvfleet.engine.bench.decode_probe import ms_per_call  # noqa: E402
from kvfleet.engine.kernels.paged_decode import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    choose_num_splits,
    paged_attention_ref,
    paged_decode_attention,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_attention_sweep import fa3_available  # noqa: E402
from gpu_kernels import DEV, S, ceilings, paged_case, rel_err  # noqa: E402

Tile = tuple[int, int, int]   # BLOCK_N, num_warps, num_stages
DEFAULT_TILE: Tile = (DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES)
TILES: list[Tile] = [DEFAULT_TILE, (64, 4, 2), (64, 4, 5), (32, 4, 6), (32, 4, 4), (64, 8, 5), (128, 4, 3),
                     (128, 4, 5)]
CASES = [(256, 1024, 32), (64, 1024, 32), (16, 1024, 32), (48, 6144, 32), (128, 4096, 32),
         (256, 1024, 16), (12, 6144, 32), (4, 6144, 32)]   # batch, keys, Hq
LONG_KEYS = 4096   # from here on each tile also runs in two splits
SPLITS = (1, 2, 4, 6, 8, 16)   # the default tile's other split counts, where each split keeps MIN_SPLIT_KEYS keys
MIN_SPLIT_KEYS = 128
GRAPH_CALLS = 8   # calls a timing graph holds (cycling through the case's cache copies)
HKV, D = 8, 128
TOLERANCE = 2e-2


def cache_copies(kv_bytes: int, l2_bytes: int, most: int = 8) -> int:
    """How many copies of a case its graph cycles through: enough that together they exceed 3x the L2 cache."""
    return max(1, min(most, math.ceil(3 * l2_bytes / kv_bytes)))


def l2_bytes() -> int:
    return 0 if DRY else int(torch.cuda.get_device_properties(0).L2_cache_size)


def sweep_case(batch: int, keys: int, hq: int, bw: float, fa3: bool) -> list[dict[str, Any]]:
    b, n = S(batch), S(keys)
    kv_bytes = b * n * HKV * D * 2 * 2
    cases = [paged_case(b, [n] * b, [1] * b, hq, HKV, D) for _ in range(cache_copies(kv_bytes, l2_bytes()))]
    c = cases[0]
    md = c["md"]
    scale = D ** -0.5
    ref = paged_attention_ref(c["q"].float(), c["cache"].float(), md.block_tables, md.seq_lens, md.query_start_loc,
                              scale)
    engine_splits = choose_num_splits(b, HKV, n)
    split_counts = sorted({engine_splits, 2}) if keys >= LONG_KEYS else [engine_splits]
    # the default tile alone at other split counts too: lease 22 put B=64 x 1k keys (one split) at 1.50x the floor
    # and B=16 (three) at 3.9x, against 1.13x at B=256
    default_only = [k for k in SPLITS if k not in split_counts and n // k >= S(MIN_SPLIT_KEYS)]
    case = f"B={b} keys={n} Hq={hq}"
    rows = []

    def measure(row: dict[str, Any], call: Callable[[dict[str, Any], torch.Tensor], None]) -> dict[str, Any]:
        outs = [torch.full_like(x["q"], float("nan")) for x in cases]
        try:
            call(c, outs[0])
            row["rel_err"] = rel_err(outs[0].float(), ref)
            row["ok"] = bool(row["rel_err"] < TOLERANCE)
            calls = [functools.partial(call, cases[i % len(cases)], outs[i % len(cases)])
                     for i in range(max(GRAPH_CALLS, len(cases)))]
            ms, row["graph"] = ms_per_call(calls, DEV, 20)
            row.update(ms=ms, GBps=kv_bytes / (ms / 1e3) / 1e9, x_floor=ms / (kv_bytes / bw * 1e3),
                       cache_copies=len(cases))
        except Exception as e:  # noqa: BLE001 - a tile that does not launch is a row too
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        return row

    for splits in split_counts + default_only:
        for tile in TILES if splits in split_counts else [DEFAULT_TILE]:
            bn, warps, stages = tile

            def call(x: dict[str, Any], out: torch.Tensor, bn: int = bn, warps: int = warps, stages: int = stages,
                     splits: int = splits) -> None:
                m = x["md"]
                paged_decode_attention(x["q"], x["cache"], m.block_tables, m.seq_lens, m.query_start_loc, scale,
                                       out, num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages)
            rows.append(measure({"case": case, "impl": "kvfleet", "tile": "{},{},{}".format(*tile),
                                 "default": tile == DEFAULT_TILE and splits == engine_splits, "splits": splits},
                                call))
    if fa3:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        def fa3_call(x: dict[str, Any], out: torch.Tensor) -> None:
            m = x["md"]
            flash_attn_varlen_func(x["q"], x["cache"][0], x["cache"][1], 1, m.query_start_loc, n,
                                   seqused_k=m.seq_lens, softmax_scale=scale, causal=True,
                                   block_table=m.block_tables, out=out, fa_version=3)
        rows.append(measure({"case": case, "impl": "vLLM FA3", "tile": "-", "default": False, "splits": "auto"},
                            fa3_call))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | kernel | tile (BLOCK_N,warps,stages) | splits | ms | GB/s | x floor | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = f"| {r['case']} | {r['impl']} | {r['tile']}{' (default)' if r['default'] else ''} | {r['splits']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} | | | |")
            continue
        eager = "" if r.get("graph", True) else " (eager)"
        lines.append(f"{head} {r['ms']:.4f}{eager} | {r['GBps']:.0f} | "
                     f"{r['x_floor']:.3f} | {r['rel_err']:.1e}{'' if r['ok'] else ' WRONG'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "decode-sweep")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(time.time()))
    bw = ceilings()["copy_bw_GBps"] * 1e9   # bytes/s of a 2 GiB device copy (read + write)
    fa3 = fa3_available()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; vLLM's FA3 {'beside' if fa3 else 'not installed'}", flush=True)
    rows: list[dict[str, Any]] = []
    for batch, keys, hq in CASES:
        case_rows = sweep_case(batch, keys, hq, bw, fa3)
        rows += case_rows
        print(table(case_rows), flush=True)
    res = {"gpu": None if DRY else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "copy_GBps": bw / 1e9, "vllm_fa3": fa3, "commit": os.environ.get("KVFLEET_COMMIT"), "rows": rows}
    (out / "decode_sweep.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "decode_sweep.txt").write_text(f"copy bandwidth {bw / 1e9:.0f} GB/s\n\n" + table(rows))
    wrong = [r for r in rows if "error" in r or not r.get("ok")]
    print(f"written {out}; {len(wrong)} rows wrong or failed")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
