"""Compile the prefill attention kernels for Hopper (sm_90) on a machine without a GPU, and report what each tile
costs: shared memory, registers per thread and the stack a spill needs. Usage:
    python bench/prefill_kernel_resources.py [BM,BN,WARPS,STAGES ...] [--json OUT]

Triton's own compiler and the ptxas it ships run here exactly as on the H200 (the interpreter the CPU tests use
checks results, not code generation); each launch is specialized as the JIT specializes Llama-3.1-8B's (32 query
heads, 8 KV heads, D 128, bf16, 16-token blocks): pointers 16-byte aligned, strides multiples of 16. A stack
above 0 means registers spilled (the 128-row tiles with 4 warps do); shared memory above 232448 bytes (227 KiB)
does not launch on an H100/H200. Exit status 1 if any variant fails to compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("prefill_kernel_resources: unset TRITON_INTERPRET (this compiles for the GPU)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvfleet.engine.kernels.prefill_attention import _prefill_kernel  # noqa: E402
from kvfleet.engine.kernels.prefill_attention_v2 import _prefill_kernel_v2, default_tile_v2  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
HOPPER_MAX_SHARED = 232448
NOT_DIVISIBLE = {"scale_log2", "batch", "num_tiles", "stride_bt"}   # floats and do_not_specialize arguments
COMMON = dict(G=4, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, SKIP_DECODE=False, UPCAST=False, PREC="tf32",
              USE_WORK=True)


def _types(fn: Any, const: dict[str, Any], pointers: dict[str, str]) -> dict[str, str]:
    """Signature: the named pointers/descriptors as given, other `*_ptr` bf16 or int32 (the metadata), ints i32."""
    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name in ("q_ptr", "cache_ptr", "out_ptr", "k_ptr", "v_ptr") else "*i32"
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    return sig


def _compile(fn: Any, const: dict[str, Any], pointers: dict[str, str], warps: int, stages: int) -> Any:
    sig = _types(fn, const, pointers)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t != "constexpr" and n not in NOT_DIVISIBLE and not t.startswith("tensordesc")}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET,
                          options=dict(num_warps=warps, num_stages=stages))


def _usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[-300:]}")
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))}


def variants(tile: tuple[int, int, int, int]) -> list[tuple[str, Any]]:
    bm, bn, warps, stages = tile
    desc = f"tensordesc<bf16[{bn},128]>"
    v2 = dict(COMMON, HQ=32, BLOCK_M=bm, BLOCK_N=bn, CACHE_STAGES=0)
    no_desc = {"k_desc": "*bf16", "v_desc": "*bf16"}
    gathered = {"kc_desc": "*bf16", "vc_desc": "*bf16"}
    cache = {"kc_desc": desc, "vc_desc": desc}
    return [
        ("v1", lambda: _compile(_prefill_kernel, dict(COMMON, BLOCK_M=bm, BLOCK_N=bn), {}, warps, stages)),
        ("v2-paged", lambda: _compile(_prefill_kernel_v2, dict(v2, HAS_KV=False, KV_TMA=False, CACHE_TMA=False),
                                      dict(gathered, **no_desc), warps, stages)),
        ("v2 new k/v by TMA", lambda: _compile(_prefill_kernel_v2, dict(v2, HAS_KV=True, KV_TMA=True, CACHE_TMA=False),
                                                 dict(gathered, k_desc=desc, v_desc=desc), warps, stages)),
        ("v2 new k/v by pointers", lambda: _compile(_prefill_kernel_v2,
                                                      dict(v2, HAS_KV=True, KV_TMA=False, CACHE_TMA=False),
                                                      dict(gathered, **no_desc), warps, stages)),
        # blocks of 64 tokens (or any multiple of BLOCK_N): the cached keys a tile at a time by TMA
        ("v2-paged, cache by TMA", lambda: _compile(_prefill_kernel_v2,
                                                      dict(v2, HAS_KV=False, KV_TMA=False, CACHE_TMA=True,
                                                           BLOCK_SIZE=64), dict(cache, **no_desc), warps, stages)),
        ("v2 k/v and cache by TMA", lambda: _compile(_prefill_kernel_v2,
                                                       dict(v2, HAS_KV=True, KV_TMA=True, CACHE_TMA=True,
                                                            BLOCK_SIZE=64),
                                                       dict(cache, k_desc=desc, v_desc=desc), warps, stages)),
        # KVFLEET_PREFILL_CACHE_EXTRA_STAGES=2: the cache loop's K/V tiles three buffers deep (same shared memory)
        ("v2 new k/v by TMA, cache +2 stages", lambda: _compile(
            _prefill_kernel_v2, dict(v2, HAS_KV=True, KV_TMA=True, CACHE_TMA=False, CACHE_STAGES=stages + 2),
            dict(gathered, k_desc=desc, v_desc=desc), warps, stages)),
        ("v2 k/v and cache by TMA, +2 stages", lambda: _compile(
            _prefill_kernel_v2, dict(v2, HAS_KV=True, KV_TMA=True, CACHE_TMA=True, BLOCK_SIZE=64,
                                     CACHE_STAGES=stages + 2), dict(cache, k_desc=desc, v_desc=desc), warps, stages)),
    ]


def json_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the path after --json, or None; the other arguments)."""
    if "--json" not in argv:
        return None, argv
    i = argv.index("--json")
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> int:
    json_out, argv = json_arg(argv)
    tiles = [tuple(int(x) for x in a.split(",")) for a in argv] or [default_tile_v2(8192, _bf16())]
    rows = [measure(name, build, {"tile": list(tile)}, ",".join(map(str, tile)))
            for tile in tiles for name, build in variants(tile)]   # type: ignore[arg-type]
    return write_rows(rows, json_out)


def measure(name: str, build: Any, fields: dict[str, Any], label: str = "",
            inspect: Callable[[Any], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compile one variant (`build()`), print and return its row: resources (and what `inspect` reads of the
    compiled kernel), or the error."""
    row: dict[str, Any] = {**fields, "kernel": name}
    head = f"{label:14} {name:36}" if label else f"{name:38}"
    try:
        k = build()
        row.update(_usage(k.asm["cubin"]), shared_bytes=k.metadata.shared)
        if inspect is not None:
            row.update(inspect(k))
        row["fits"] = row["shared_bytes"] <= HOPPER_MAX_SHARED
        print(f"{head} shared {row['shared_bytes']:7d}{'' if row['fits'] else ' (too much)'}"
              f"  registers {row['registers']:3d}  spill stack {row['stack_bytes']:4d}", flush=True)
    except Exception as e:  # noqa: BLE001 - report every variant
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"{head} FAILED {row['error']}", flush=True)
    return row


def write_rows(rows: list[dict[str, Any]], json_out: str | None) -> int:
    """Write the rows as JSON when asked; exit status 1 if any variant failed to compile."""
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


def _bf16() -> Any:
    import torch

    return torch.bfloat16


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
