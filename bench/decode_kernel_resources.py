"""Compile the decode attention kernels for Hopper (sm_90) on a machine without a GPU, as
`prefill_kernel_resources.py` does for prefill: the decode kernel (with and without the shared-prefix pass, one and
several key splits), its merge kernel, and the shared-prefix kernel, specialized as Llama-3.1-8B's launches (32 query
heads, 8 KV heads, D 128, bf16, 16-token blocks). Usage:
    python bench/decode_kernel_resources.py [--json OUT]

Exit status 1 if a variant fails to compile.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("decode_kernel_resources: unset TRITON_INTERPRET (this compiles for the GPU)")

from prefill_kernel_resources import _compile, measure, write_rows  # noqa: E402

from kvfleet.engine.kernels import shared_prefix as pk  # noqa: E402
from kvfleet.engine.kernels.paged_decode import (  # noqa: E402
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    DEFAULT_NUM_WARPS,
    _decode_kernel,
    _merge_kernel,
)

FP32 = {name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "pre_out_ptr", "pre_lse_ptr", "po_ptr", "plse_ptr")}
LLAMA = dict(HEAD_DIM=128, D_PAD=128)


def variants() -> list[tuple[str, Callable[[], Any]]]:
    out: list[tuple[str, Callable[[], Any]]] = []
    for shared in (False, True):
        # direct: two splits by length (KVFLEET_DECODE_LONG_SPLIT=2048: splits of >= 2048 keys), a sequence left
        # with one split written by it
        for splits, direct, min_tiles in ((1, False, 1), (8, False, 1), (2, True, 32)):
            const = dict(LLAMA, G=4, G_PAD=16, BLOCK_SIZE=16, BLOCK_N=DEFAULT_BLOCK_N, NUM_SPLITS=splits,
                         MIN_TILES=min_tiles, FUSED_MERGE=False, NUM_KV_HEADS=8, S_PAD=splits, SHARED=shared,
                         UPCAST=False, PREC="tf32", DIRECT_SINGLE=direct)
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


def main(argv: list[str]) -> int:
    json_out = argv[argv.index("--json") + 1] if "--json" in argv else None
    return write_rows([measure(name, build, {}) for name, build in variants()], json_out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
