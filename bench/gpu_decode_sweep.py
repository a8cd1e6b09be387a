"""Decode attention's tile at the batches of a loaded server, against the bytes it must read (one call). Usage:
    python bench/gpu_decode_sweep.py OUT_DIR      (KVFLEET_GPU_DRYRUN=1: tiny sizes on CPU under the interpreter)

Writes OUT_DIR/decode_sweep.json and OUT_DIR/decode_sweep.txt.

Why: at 3 stages (the default, `KVFLEET_DECODE_TILE=64,4,3`) Triton's pipeliner gives the block-table load a stage of
its own and keeps one K and one V tile in shared memory: the next tile's copy starts after the tile before it is
used, so within a program no copy is in flight during the math (`bench/decode_kernel_resources.py`, `kv_buffers`).
The first kernel round swept only 2 and 3 stages (1.20x the copy floor at B=256, ctx 1024, on the H200). 5 stages
at 64 keys, or 6 at 32, keep two tiles. In the 300-at-once row up to ~300 decodes of ~1k keys share every mixed
step with prefills, so this kernel is a candidate for the ~4 % its steps lose to vLLM's.

Cases: Llama-3.1-8B heads (32 query, 8 KV, D 128, bf16, 16-token blocks, blocks scattered) at B = 256, 64 and 16
with 1,024 keys, 128 x 4,096, and Qwen3-0.6B's 16 query heads at B = 256; the engine's split count for each
(`choose_num_splits`). Each tile: the error against the float32 reference (NaN-poisoned output first), then the
median of 30 timed calls (CUDA events), GB/s of K/V read and the time over the copy floor (measured copy bandwidth).
A tile worth trying end to end: `KVFLEET_DECODE_TILE=64,4,5` in the online or offline A/B stages.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DRY = os.environ.get("KVFLEET_GPU_DRYRUN") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kvfleet.engine.kernels.paged_decode import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    choose_num_splits,
    paged_attention_ref,
    paged_decode_attention,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import DEV, S, bench_ms, paged_case, rel_err  # noqa: E402

Tile = tuple[int, int, int]   # BLOCK_N, num_warps, num_stages
DEFAULT_TILE: Tile = (DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES)
TILES: list[Tile] = [DEFAULT_TILE, (64, 4, 2), (64, 4, 5), (32, 4, 6), (32, 4, 4), (64, 8, 5), (128, 4, 3),
                     (128, 4, 5)]
CASES = [(256, 1024, 32), (64, 1024, 32), (16, 1024, 32), (128, 4096, 32), (256, 1024, 16)]   # batch, keys, Hq
HKV, D = 8, 128
TOLERANCE = 2e-2


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write)."""
    x = torch.randn(S(2**30), dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() * 2 / (ms / 1e3)


def sweep_case(batch: int, keys: int, hq: int, bw: float) -> list[dict[str, Any]]:
    b, n = S(batch), S(keys)
    c = paged_case(b, [n] * b, [1] * b, hq, HKV, D)
    md = c["md"]
    scale = D ** -0.5
    ref = paged_attention_ref(c["q"].float(), c["cache"].float(), md.block_tables, md.seq_lens, md.query_start_loc,
                              scale)
    kv_bytes = b * n * HKV * D * 2 * 2
    splits = choose_num_splits(b, HKV, n)
    rows = []
    for tile in TILES:
        bn, warps, stages = tile
        row: dict[str, Any] = {"case": f"B={b} keys={n} Hq={hq}", "tile": "{},{},{}".format(*tile),
                               "default": tile == DEFAULT_TILE, "splits": splits}
        out = torch.full_like(c["q"], float("nan"))

        def call(out: torch.Tensor = out, bn: int = bn, warps: int = warps, stages: int = stages) -> None:
            paged_decode_attention(c["q"], c["cache"], md.block_tables, md.seq_lens, md.query_start_loc, scale, out,
                                   num_splits=splits, block_n=bn, num_warps=warps, num_stages=stages)
        try:
            call()
            row["rel_err"] = rel_err(out.float(), ref)
            row["ok"] = bool(row["rel_err"] < TOLERANCE)
            ms = bench_ms(call, 30)
            row.update(ms=ms, GBps=kv_bytes / (ms / 1e3) / 1e9, x_floor=ms / (kv_bytes / bw * 1e3))
        except Exception as e:  # noqa: BLE001 - a tile that does not launch is a row too
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | tile (BLOCK_N,warps,stages) | splits | ms | GB/s | x floor | rel err |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['tile']} | {r['splits']} | error: {r['error'][:80]} | | | |")
            continue
        mark = " (default)" if r["default"] else ""
        lines.append(f"| {r['case']} | {r['tile']}{mark} | {r['splits']} | {r['ms']:.4f} | {r['GBps']:.0f} | "
                     f"{r['x_floor']:.3f} | {r['rel_err']:.1e}{'' if r['ok'] else ' WRONG'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "decode-sweep")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(int(time.time()))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for batch, keys, hq in CASES:
        case_rows = sweep_case(batch, keys, hq, bw)
        rows += case_rows
        print(table(case_rows), flush=True)
    res = {"gpu": None if DRY else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "copy_GBps": bw / 1e9, "commit": os.environ.get("KVFLEET_COMMIT"), "rows": rows}
    (out / "decode_sweep.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "decode_sweep.txt").write_text(f"copy bandwidth {bw / 1e9:.0f} GB/s\n\n" + table(rows))
    wrong = [r for r in rows if "error" in r or not r.get("ok")]
    print(f"written {out}; {len(wrong)} rows wrong or failed")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
