"""Compile the Gluon FA3-style prefill kernel (kernels/prefill_attention_gluon.py) for Hopper (sm_90) on a machine
without a GPU, and report per variant what it costs and whether the compiled code keeps the tensor cores busy under
the softmax. Usage:
    python bench/gluon_attention_resources.py [SCHED,BM,BN,NB,WARPS[,D] ...] [--json OUT]
SCHED is ``fa3`` (S_j and P_{j-1} V_{j-1} issued, softmax(S_j) under the latter) or ``ahead`` (S_{j+1} and
P_{j-1} V_{j-1} issued before softmax(S_j)), either with ``-ws`` (a producer warp issues the TMA refills:
``warp_specialize=True``) or ``-ws2`` (that, and the WARPS split into two consumer partitions of one warpgroup, a
half of the query rows each: ``consumers=2``), ``fa3-pp`` (``-ws2`` with the two issuing their MMAs in turns:
``pingpong=True``), and any of them with ``-paged`` (or, warp-specialized, ``-paged-at-once``: the producer loads a
tile's block numbers in one load, ``pages_at_once=True``) (the chunk kernel, `prefill_attention_gluon_paged`: every
key from a paged cache of 16-token blocks, one copy a block); D defaults to 128.

Each launch is specialized as Llama-3.1-8B's (32 query heads, 8 KV heads, bf16, the work list): Gluon kernels compile
through their own source class (``GluonASTSource``: no layout inference, the layouts are the kernel's), then Triton's
ptxas, as on the H200. Per variant:
  registers, spill stack (cuobjdump), shared memory (must be <= 232448 bytes);
  serialized: ptxas's C7514 "wgmma.mma_async instructions are serialized" (every wgmma waited for right after issue);
  ptx: per key loop, the MMA groups in flight at the loop's first ``ex2.approx`` (SS: ``Q K^T``, both operands in
       shared memory; RS: ``P V``, P from registers). An SS group in flight there is S_{j+1}, issued before tile j's
       exponentials (the softmax reads S_j, which has retired);
  sass: per key loop, how many MUFU.EX2 ptxas scheduled while an HGMMA group was in flight (ptxas reorders: it may
       hoist a wait above the softmax or sink an MMA issue below it, which the PTX order does not show), and its
       CTA barriers (BAR.SYNC: Triton's, around the TMA refills and barrier waits; they keep the warpgroups in step).
Exit status 1 if a variant fails to compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("gluon_attention_resources: unset TRITON_INTERPRET (this compiles for the GPU)")

import torch  # noqa: E402
import triton  # noqa: E402
from prefill_kernel_resources import CUOBJDUMP, HOPPER_MAX_SHARED, TARGET, _usage, json_arg, write_rows  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from kvfleet.engine.kernels.prefill_attention_gluon import (  # noqa: E402
    SCHEDULE_NAMES,
    _prefill_gluon_kernel,
    kernel_layouts,
    named_tile,
    smem_layout,
)

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
# (schedule, block_m, block_n, num_buffers, num_warps, head_dim): the defaults first
DEFAULT_VARIANTS = [("fa3", 128, 128, 2, 8, 128), ("ahead", 128, 64, 2, 8, 128), ("fa3-ws", 128, 128, 2, 8, 128),
                    ("ahead-ws", 128, 64, 2, 8, 128), ("fa3", 128, 128, 3, 8, 128), ("fa3", 128, 64, 2, 8, 128),
                    ("ahead", 128, 128, 2, 8, 128), ("fa3", 128, 128, 2, 8, 64)]
DIVISIBLE = ("qsl_ptr", "work_ptr", "out_ptr", "table_ptr", "seq_lens_ptr", "stride_ot", "stride_oh")
PAGE = 16   # the engine's default cache block


def compile_variant(sched: str, bm: int, bn: int, nb: int, warps: int, d: int = 128) -> Any:
    """The kernel compiled for sm_90 as `prefill_attention_gluon` (or, ``-paged``, `prefill_attention_gluon_paged`)
    launches it with a work list."""
    fn = _prefill_gluon_kernel
    at_once = sched.endswith("-paged-at-once")
    sched = sched.removesuffix("-at-once")
    paged = sched.endswith("-paged")
    tile = named_tile(sched.removesuffix("-paged"), bm, bn, nb, warps)
    consumers = tile.consumers
    const = dict(HQ=32, G=4, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, NUM_BUFFERS=nb, USE_WORK=True,
                 S_AHEAD=tile.s_ahead, WARP_SPEC=tile.warp_specialize, PAGED=paged, CONSUMERS=consumers,
                 PINGPONG=tile.pingpong, PAGES_AT_ONCE=at_once,
                 **kernel_layouts(bm // consumers, bn, d, warps // consumers))
    kv_rows = PAGE if paged else bn
    descs = {"q_desc": (bm, smem_layout(bm, d, torch.bfloat16)),
             "k_desc": (kv_rows, smem_layout(kv_rows, d, torch.bfloat16)),
             "v_desc": (kv_rows, smem_layout(kv_rows, d, torch.bfloat16))}
    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            rows, layout = descs[name]
            sig[name] = f"tensordesc<bf16[{rows}, {d}],{layout!r}>"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if name == "out_ptr" else "*i32"
        else:
            sig[name] = "fp32" if name == "scale_log2" else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    return triton.compile(GluonASTSource(fn, sig, const, attrs), target=TARGET,
                          options=dict(num_warps=warps // consumers))


def ptxas_serializes(ptx: str) -> bool:
    """ptxas's C7514/C7515 warning: it serialized every wgmma of the kernel (Triton drops ptxas's log: rerun it)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return "wgmma.mma_async instructions are serialized" in log


def ptx_loops(ptx: str) -> list[list[str]]:
    """The bodies of the PTX's loops: from a label LLVM marks as a loop header to the branch back to it."""
    lines = ptx.splitlines()
    headers: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", line)
        if m and ("Loop Header" in line or (i + 1 < len(lines) and "Loop Header" in lines[i + 1])):
            headers[m.group(1)] = i
    spans = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in headers and headers[m.group(1)] < i:
            spans.append((headers[m.group(1)], i))
    # innermost only: a warp-specialized kernel's worker partitions run inside an outer dispatch loop
    return [lines[a:b + 1] for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]


def ptx_overlap(body: list[str]) -> dict[str, Any] | None:
    """MMA groups (SS/RS) in flight at the loop's first ex2, and how many ex2 run under an MMA, in PTX order."""
    pending: list[str] = []
    group = ""
    first: list[str] | None = None
    ex2 = under = 0
    for line in body:
        if "wgmma.mma_async" in line:
            operands = line.split("}", 1)[1].lstrip(" ,") if "}" in line else ""
            group = "RS" if operands.startswith("{") else "SS"
        elif "wgmma.commit_group" in line:
            pending.append(group)
        elif m := re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", line):
            n = int(m.group(1))
            pending = pending[len(pending) - n:] if 0 < n < len(pending) else ([] if n == 0 else pending)
        elif "ex2.approx" in line:
            ex2 += 1
            under += bool(pending)
            if first is None:
                first = list(pending)
    if ex2 == 0:
        return None
    return {"in_flight_at_first_ex2": first, "ex2": ex2, "ex2_under_mma": under}


def sass_overlap(sass: str) -> list[dict[str, int]]:
    """Per SASS loop (a backward branch, its span holding no EXIT): MUFU.EX2 scheduled while an HGMMA group is in
    flight (issued and not retired by a WARPGROUP.DEPBAR), of all its MUFU.EX2."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    bounds = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            span = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("HGMMA" in t for t in span) and any("MUFU.EX2" in t for t in span) and \
                    not any(t.strip().endswith("EXIT") for t in span):
                bounds.append((int(m.group(1), 16), addr))
    # innermost only (a warp-specialized kernel's worker partitions run inside an outer dispatch loop)
    loops = [[t for a, t in ins if lo <= a <= hi] for lo, hi in bounds
             if not any(lo <= c and d <= hi and (c, d) != (lo, hi) for c, d in bounds)]
    out = []
    for span in loops:
        groups, open_group, ex2, under = 0, False, 0, 0
        bars = sum("BAR.SYNC" in t for t in span)
        for t in span:
            if "HGMMA" in t:
                open_group = "gsb0" not in t
                groups += 0 if open_group else 1
            elif m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", t):
                groups = min(groups, int(m.group(1), 16))
            elif "MUFU.EX2" in t:
                ex2 += 1
                under += groups > 0 or open_group
        out.append({"ex2": ex2, "ex2_under_mma": under, "bar_sync": bars})
    return out


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def measure(variant: tuple[str, int, int, int, int, int]) -> dict[str, Any]:
    sched, bm, bn, nb, warps, d = variant
    label = f"{sched} {bm}x{bn} D{d} buffers {nb} warps {warps}"
    row: dict[str, Any] = {"kernel": label, "schedule": sched, "block_m": bm, "block_n": bn, "num_buffers": nb,
                           "num_warps": warps, "head_dim": d}
    try:
        k = compile_variant(sched, bm, bn, nb, warps, d)
        row.update(_usage(k.asm["cubin"]), shared_bytes=k.metadata.shared)
        row["fits"] = row["shared_bytes"] <= HOPPER_MAX_SHARED
        row["serialized"] = ptxas_serializes(k.asm["ptx"])
        loops = [o for o in (ptx_overlap(b) for b in ptx_loops(k.asm["ptx"])) if o is not None]
        row["ptx_loops"] = loops
        row["ptx_wgmma"] = "wgmma.mma_async" in k.asm["ptx"]
        # the softmax of tile j starts with the next tile's Q K^T (SS) in flight, in every key loop
        row["ptx_s_next_before_ex2"] = bool(loops) and all("SS" in (o["in_flight_at_first_ex2"] or []) for o in loops)
        row["ptx_softmax_under_mma"] = bool(loops) and all(o["in_flight_at_first_ex2"] for o in loops)
        row["sass_loops"] = sass_overlap(_sass(k.asm["cubin"]))
        sass_txt = " ".join(f"{o['ex2_under_mma']}/{o['ex2']} ({o['bar_sync']} bar)" for o in row["sass_loops"])
        ptx_txt = " ".join("+".join(o["in_flight_at_first_ex2"] or ["none"]) for o in loops)
        print(f"{label:42} shared {row['shared_bytes']:6d}{'' if row['fits'] else ' (too much)'}  registers "
              f"{row['registers']:3d}  spill stack {row['stack_bytes']:3d}  serialized {row['serialized']!s:5}  "
              f"ptx in flight at 1st ex2: {ptx_txt}  sass ex2 under mma: {sass_txt}", flush=True)
    except Exception as e:  # noqa: BLE001 - report every variant
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"{label:42} FAILED {row['error']}", flush=True)
    return row


def parse_variant(raw: str) -> tuple[str, int, int, int, int, int]:
    sched, *nums = raw.split(",")
    if sched.removesuffix("-at-once").removesuffix("-paged") not in SCHEDULE_NAMES or len(nums) not in (4, 5):
        sys.exit(f"gluon_attention_resources: expected SCHED,BM,BN,NB,WARPS[,D], SCHED one of {SCHEDULE_NAMES} "
                 f"(and -paged), got {raw!r}")
    bm, bn, nb, warps, *d = (int(x) for x in nums)
    return sched, bm, bn, nb, warps, d[0] if d else 128


def main(argv: list[str]) -> int:
    json_out, argv = json_arg(argv)
    variants = [parse_variant(a) for a in argv] or DEFAULT_VARIANTS
    return write_rows([measure(v) for v in variants], json_out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
