"""Compile the small-M bf16 GEMM (kernels/small_m_gemm.py) for Hopper (sm_90) on a machine without a GPU and report
what each launch costs: registers per thread, the stack a spill needs, shared memory, and how the weights are
loaded (16-byte ``cp.async`` copies, 16-byte ``ld.global``). Usage:
    python bench/small_m_gemm_resources.py [--m 1,16] [--json OUT]

Each variant is the default config (``default_small_m_config``, 132 SMs) of a Llama-3.1-8B shape (qkv, o, gate_up,
down, LM head) at the given M, specialized as the JIT specializes it there: pointers 16-byte aligned, N, K and
strides multiples of 16, M not specialized. Triton's compiler and the ptxas it ships run here as on the H200 (the
interpreter the CPU tests use checks results, not code generation). A stack above 0 means registers spilled;
shared memory above 232448 bytes (227 KiB) does not launch on an H100/H200. Exit status 1 if any variant fails.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("small_m_gemm_resources: unset TRITON_INTERPRET (this compiles for the GPU)")

import triton  # noqa: E402
from prefill_kernel_resources import HOPPER_MAX_SHARED, TARGET, _usage  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvfleet.engine.kernels.small_m_gemm import (  # noqa: E402
    SmallMGemmConfig,
    _small_m_gemm_kernel,
    _split_k_sum_kernel,
    block_m_for,
    default_small_m_config,
)

SMS = 132
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}   # N, K


def _compile(fn: Any, sig: dict[str, str], const: dict[str, Any], warps: int, stages: int) -> Any:
    sig = {**sig, **{k: "constexpr" for k in const}}
    aligned = [i for i, name in enumerate(fn.arg_names) if sig[name] != "constexpr" and name not in ("M", "splits")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET,
                          options={"num_warps": warps, "num_stages": stages})


def compile_gemm(m: int, cfg: SmallMGemmConfig) -> Any:
    """The main kernel as a bf16 launch of ``cfg`` at ``m`` rows (float32 partial sums when it splits K)."""
    split = cfg.split_k > 1
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*fp32" if split else "*bf16",
           **{name: "i32" for name in ("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_om",
                                       "stride_os")}}
    const = {"BLOCK_M": block_m_for(m, cfg.use_dot), "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
             "NUM_STAGES": cfg.num_stages, "EVEN_K": True, "EVEN_N": True, "SPLIT": split, "HAS_BIAS": False,
             "USE_DOT": cfg.use_dot, "UPCAST": False, "PREC": "tf32", "X_VECTOR": cfg.x_vector}
    return _compile(_small_m_gemm_kernel, sig, const, cfg.num_warps, cfg.num_stages)


def compile_reduce() -> Any:
    sig = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           **{name: "i32" for name in ("M", "N", "splits", "stride_ps", "stride_pm", "stride_om")}}
    return _compile(_split_k_sum_kernel, sig, {"HAS_BIAS": False, "BLOCK": 1024}, 4, 1)


def code_facts(k: Any) -> dict[str, Any]:
    """How the compiled kernel loads and multiplies (from its PTX)."""
    ptx = k.asm["ptx"]
    return {"cp_async16": len(re.findall(r"cp\.async\.cg\.shared\.global[\w.:]* \[[^]]*\], \[[^]]*\], (?:0x10|16)",
                                         ptx)),
            "ld_global_v4": len(re.findall(r"ld\.global[\w.:]*\.v4\.(?:b32|u32|f32)", ptx)),
            "ld_global_narrow": len(re.findall(r"ld\.global[\w.:]*\.(?:b16|u16|b8|u8)\s", ptx)),
            "mma": "mma.sync" in ptx or "wgmma" in ptx}


def measure(fields: dict[str, Any], build: Any) -> dict[str, Any]:
    """Compile one variant (``build()``), print and return its row: resources and load facts, or the error."""
    row: dict[str, Any] = dict(fields)
    name = fields.get("config", fields.get("kernel", ""))
    head = f"{fields.get('shape', ''):8} M={fields.get('M', '-'):<3} {name:22}"
    try:
        k = build()
        row.update(_usage(k.asm["cubin"]), shared_bytes=k.metadata.shared, **code_facts(k))
        row["fits"] = row["shared_bytes"] <= HOPPER_MAX_SHARED
        print(f"{head} shared {row['shared_bytes']:6d}{'' if row['fits'] else ' (too much)'}  registers "
              f"{row['registers']:3d}  spill stack {row['stack_bytes']:4d}  cp.async16 {row['cp_async16']:3d}  "
              f"ld.v4 {row['ld_global_v4']:3d}  mma {row['mma']}", flush=True)
    except Exception as e:  # noqa: BLE001 - report every variant
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"{head} FAILED {row['error']}", flush=True)
    return row


def default_rows(ms: list[int]) -> list[dict[str, Any]]:
    """The default config of every Llama-8B shape at each M (each distinct compile once), and the split-K sum."""
    rows: list[dict[str, Any]] = []
    built: dict[tuple[int, SmallMGemmConfig], dict[str, Any]] = {}
    for m in ms:
        for shape, (n, k) in LLAMA_8B.items():
            cfg = default_small_m_config(m, n, k, SMS)
            key = (block_m_for(m, cfg.use_dot), cfg)
            fields = {"shape": shape, "M": m, "N": n, "K": k, "config": cfg.label(), "programs":
                      triton.cdiv(n, cfg.block_n) * cfg.split_k}
            if key in built:   # the same compiled kernel as an earlier row
                rows.append({**built[key], **fields})
                continue
            built[key] = measure(fields, lambda m=m, cfg=cfg: compile_gemm(m, cfg))
            rows.append(built[key])
    rows.append(measure({"kernel": "split-K sum"}, compile_reduce))
    return rows


def main(argv: list[str]) -> int:
    json_out = argv[argv.index("--json") + 1] if "--json" in argv else None
    ms = [int(v) for v in argv[argv.index("--m") + 1].split(",")] if "--m" in argv else [1, 16]
    rows = default_rows(ms)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
