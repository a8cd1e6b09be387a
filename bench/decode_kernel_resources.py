"""Compile the decode attention kernels for Hopper (sm_90) on a machine without a GPU, as
`prefill_kernel_resources.py` does for prefill: the decode kernel (with and without the shared-prefix pass, one and
several key splits), its merge kernel, and the shared-prefix kernel, specialized as Llama-3.1-8B's launches (32 query
heads, 8 KV heads, D 128, bf16, 16-token blocks); and the rotary + cache-write kernel for Llama's and Qwen3-0.6B's
heads (the latter with its per-head q/k norm). Usage:
    python bench/decode_kernel_resources.py [BLOCK_N,WARPS,STAGES ...] [--json OUT]

Tiles given (KVFLEET_DECODE_TILE's form) compile the decode kernel's one-split variants at each, besides the default
tile's full set. Each decode row says how many K/V tiles the loop keeps in shared memory (`kv_buffers`): Triton's
pipeliner gives the block-table load a stage of its own, so at 3 stages (the default) one K and one V buffer are
filled after the tile before them is used, with no copy in flight during the math; it takes 5 to keep two.

Exit status 1 if a variant fails to compile.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("decode_kernel_resources: unset TRITON_INTERPRET (this compiles for the GPU)")

import triton  # noqa: E402
from prefill_kernel_resources import TARGET, _compile, json_arg, measure, write_rows  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvfleet.engine.kernels import shared_prefix as pk  # noqa: E402
from kvfleet.engine.kernels.paged_decode import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    _decode_kernel,
    _merge_kernel,
)
from kvfleet.engine.kernels.rotary_cache import _rotary_cache_kernel  # noqa: E402

FP32 = {name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "pre_out_ptr", "pre_lse_ptr", "po_ptr", "plse_ptr")}
LLAMA = dict(HEAD_DIM=128, D_PAD=128)


Tile = tuple[int, int, int]   # BLOCK_N, num_warps, num_stages
DEFAULT_TILE: Tile = (DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES)


def kv_buffers(kernel: Any) -> dict[str, Any]:
    """How many [BLOCK_N, D] K tiles the decode loop keeps in shared memory (its TTGIR's K/V allocations)."""
    found = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+xbf16", kernel.asm["ttgir"])
    return {"kv_buffers": int(found[0]) if found else 0}


def _decode_const(tile: Tile, splits: int, direct: bool, min_tiles: int, shared: bool) -> dict[str, Any]:
    return dict(LLAMA, G=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=tile[0], NUM_SPLITS=splits, MIN_TILES=min_tiles,
                FUSED_MERGE=False, NUM_KV_HEADS=8, S_PAD=splits, SHARED=shared, UPCAST=False, PREC="tf32",
                DIRECT_SINGLE=direct)


def tile_variants(tile: Tile) -> list[tuple[str, Callable[[], Any]]]:
    """The decode kernel's one-split launches (with and without the shared-prefix pass) at another tile."""
    label = "tile {},{},{}".format(*tile)
    out: list[tuple[str, Callable[[], Any]]] = []
    for shared in (False, True):
        const = _decode_const(tile, 1, False, 1, shared)
        out.append((f"decode splits=1{' shared' if shared else ''} {label}",
                    lambda c=const: _compile(_decode_kernel, c, FP32, tile[1], tile[2])))
    return out


def variants() -> list[tuple[str, Callable[[], Any]]]:
    out: list[tuple[str, Callable[[], Any]]] = []
    for shared in (False, True):
        # direct: two splits by length (KVFLEET_DECODE_LONG_SPLIT=2048: splits of >= 2048 keys), a sequence left
        # with one split written by it
        for splits, direct, min_tiles in ((1, False, 1), (8, False, 1), (2, True, 32)):
            const = _decode_const(DEFAULT_TILE, splits, direct, min_tiles, shared)
            out.append((f"decode splits={splits}{' direct' if direct else ''}{' shared' if shared else ''}",
                        lambda c=const: _compile(_decode_kernel, c, FP32, DEFAULT_NUM_WARPS, DEFAULT_NUM_STAGES)))
        for splits, direct, min_tiles in ((8, False, 1), (2, True, 32)):
            merge = dict(LLAMA, NUM_SPLITS=splits, S_PAD=splits, NUM_Q_HEADS=32, SHARED=shared, DIRECT_SINGLE=direct,
                         BLOCK_N=DEFAULT_BLOCK_N, MIN_TILES=min_tiles)
            out.append((f"merge{' direct' if direct else ''}{' shared' if shared else ''}",
                        lambda c=merge: _compile(_merge_kernel, c, FP32, 4, 1)))
    prefix = dict(LLAMA, G=4, NUM_Q_HEADS=32, BLOCK_SIZE=16, BLOCK_M=pk.DEFAULT_BLOCK_M, BLOCK_N=pk.DEFAULT_BLOCK_N,
                  UPCAST=False, PREC="tf32")
    out.append(("shared prefix", lambda: _compile(pk._shared_prefix_kernel, prefix, FP32, pk.DEFAULT_NUM_WARPS,
                                                  pk.DEFAULT_NUM_STAGES)))
    return out


ROTARY_ARG_TYPES = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "cache_ptr", "qw_ptr", "kw_ptr"), "*bf16"),
                    "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32"}


def _compile_rotary_cache(hq: int, norm: bool, rotate_k: bool) -> Any:
    """`_rotary_cache_kernel` as the attention op launches it for a model of `hq` query heads (8 KV heads, D 128,
    16-token blocks, bf16, per-token cos/sin of D/2), with Qwen3's per-head norm or without."""
    const = dict(HQ=hq, HK=8, HQ_PAD=hq, HK_PAD=8, HALF=64, HALF_PAD=64, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16,
                 ROTATE_K=rotate_k, NORM=norm)
    fn = _rotary_cache_kernel
    sig = {n: "constexpr" if n in const else ROTARY_ARG_TYPES.get(n, "i32") for n in fn.arg_names}   # i32: strides
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t not in ("constexpr", "fp32")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=dict(num_warps=4, num_stages=1))


def rotary_variants() -> list[tuple[str, Callable[[], Any]]]:
    """The rotary + cache-write kernel for Llama-3.1-8B's heads and Qwen3-0.6B's (normalised), k rotated in place
    or only cached."""
    return [(f"rotary cache hq={hq}{' norm' if norm else ''}{' rotate_k' if rotate_k else ''}",
             lambda hq=hq, norm=norm, rotate_k=rotate_k: _compile_rotary_cache(hq, norm, rotate_k))
            for hq, norm in ((32, False), (16, True)) for rotate_k in (False, True)]


def parse_tile(text: str) -> Tile:
    bn, warps, stages = (int(x) for x in text.split(","))
    return bn, warps, stages


def main(argv: list[str]) -> int:
    json_out, argv = json_arg(argv)
    tiles = [parse_tile(a) for a in argv]
    builds = variants() + [v for t in tiles for v in tile_variants(t)] + rotary_variants()
    rows = [measure(name, build, {}, inspect=kv_buffers if name.startswith("decode") else None)
            for name, build in builds]
    return write_rows(rows, json_out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
