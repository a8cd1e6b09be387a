"""The FP8 GEMM compiled for an H100/H200 (sm_90) on this GPU-less machine: Triton's own compiler, down to PTX and
a cubin (ptxas ships with Triton). It checks what the interpreter cannot: that every tile the engine picks for
Llama-8B's shapes compiles for sm_90 with FP8 operands, that its weight loads are pipelined 16-byte async copies
(the kernel is bound by reading weights: byte loads or an unpipelined loop would waste the point of it), and that
the products run on tensor cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvfleet.engine.kernels import fp8_gemm as fg

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

# Runs in a child process: this one interprets (tests/engine_kernels/conftest.py), and Triton's interpreter patches the
# language objects the compiler needs. Prints, per tile, what the compiled kernel does.
_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvfleet.engine.kernels import fp8_gemm as fg

ALIGNED = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13]   # pointers, N, K, k_per_split, strides: multiples of 16
out = {}
for bm, bn, bk, split_k, warps, stages, acc, split in json.loads(sys.argv[1]):
    sig = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
           "bias_ptr": "*fp32", "out_ptr": "*fp32" if split else "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "k_per_split": "i32", "stride_am": "i32", "stride_wn": "i32", "stride_om": "i32", "stride_os": "i32"}
    const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "EVEN_K": True, "EVEN_N": True, "SPLIT": split,
             "HAS_BIAS": False, "DOT_F32": False, "IMPRECISE_ACC": acc}
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in ALIGNED}
    key = f"{bm},{bn},{bk},{split_k},{warps},{stages},{acc},{int(split)}"
    try:
        k = triton.compile(ASTSource(fg._fp8_gemm_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
    except Exception as e:
        out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        continue
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    out[key] = {"fp8_operands": "f8E4M3FN" in ttgir,
                "async16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (?:0x10|16)", ptx)),
                "wait_group": "cp.async.wait_group" in ptx,
                "byte_loads": bool(re.search(r"ld\.global(\.\w+)*\.(b8|u8)", ptx)),
                "shared": k.metadata.shared, "wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx,
                "wgmma_e4m3": bool(re.search(r"wgmma\S*e4m3", ptx))}
print(json.dumps(out))
"""


def _engine_tiles() -> list[tuple[fg.Fp8GemmConfig, bool]]:
    tiles = set()
    for n, k in LLAMA_8B.values():
        for m in (1, 16, 32, 64, 128, 256):
            cfg = fg.default_config(m, n, k, num_sms=132)
            tiles.add((cfg, cfg.split_k > 1))
    return sorted(tiles, key=lambda t: (t[0].label(), t[1]))


def _key(cfg: fg.Fp8GemmConfig, split: bool) -> str:
    return (f"{cfg.block_m},{cfg.block_n},{cfg.block_k},{cfg.split_k},{cfg.num_warps},{cfg.num_stages},"
            f"{cfg.imprecise_acc},{int(split)}")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, Any]]:
    tiles = [[c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages, c.imprecise_acc, s]
             for c, s in _engine_tiles()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(tiles)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cfg, split", _engine_tiles(),
                         ids=lambda v: v.label() if isinstance(v, fg.Fp8GemmConfig) else f"split={v}")
def test_engine_tiles_compile_for_sm90_with_pipelined_wide_loads(compiled: dict[str, dict[str, Any]],
                                                                 cfg: fg.Fp8GemmConfig, split: bool) -> None:
    r = compiled[_key(cfg, split)]
    assert "error" not in r, r.get("error")
    assert r["fp8_operands"]   # E4M3 tiles, not widened before the load
    assert r["async16"] > 0 and r["wait_group"], "weight tiles are not loaded by pipelined 16-byte async copies"
    assert not r["byte_loads"]
    assert r["shared"] >= 2 * (cfg.block_m + cfg.block_n) * cfg.block_k   # at least two stages in flight
    assert r["wgmma"] or r["mma_sync"]
    if cfg.block_m >= 64:
        assert r["wgmma"] and r["wgmma_e4m3"]   # Hopper's FP8 tensor-core instruction


def test_engine_tiles_cover_the_batch_sizes() -> None:
    prefixes = {cfg.label()[:cfg.label().index("n")] for cfg, _ in _engine_tiles()}
    assert {"m16", "m32", "m64", "m128"} <= prefixes
