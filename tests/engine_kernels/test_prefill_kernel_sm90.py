"""The prefill kernels compile for Hopper (sm_90) with Triton's real compiler and ptxas, on this CPU.

The interpreter the other kernel tests use checks results, not code generation: a construct only the compiler
rejects (a non-constexpr global, a type mismatch between branches), a tile that spills registers or needs more
shared memory than an H200 has would pass them and fail on the GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_v2_default_tiles_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")   # compile, do not reuse
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill_kernel_resources.py"),
                           "128,64,8,3", "16,64,4,2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 16    # eight variants per tile
    assert not [r for r in rows if "error" in r]
    # what the engine launches on Hopper with KVFLEET_PREFILL_KERNEL=v2 / v2-paged, with the cache gathered (blocks
    # smaller than a key tile) or by TMA (v1 and the pointer fallback for new K/V are compiled above but not held to
    # this)
    launched = [r for r in rows if r["kernel"] in ("v2-paged", "v2 new k/v by TMA",
                                                   "v2-paged, cache by TMA", "v2 k/v and cache by TMA",
                                                   "v2 new k/v by TMA, cache +2 stages",
                                                   "v2 k/v and cache by TMA, +2 stages")]
    assert len(launched) == 12
    for r in launched:
        assert r["fits"] and r["stack_bytes"] == 0, r


def test_decode_and_shared_prefix_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """The decode kernel with and without the shared-prefix pass, its merge kernel and the shared-prefix kernel, as
    the engine launches them for Llama-3.1-8B, and the rotary + cache-write kernel for Llama's heads and Qwen3's
    with its per-head norm (the interpreter runs them, the compiler alone can reject them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_kernel_resources.py"), "64,4,5", "32,4,6",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["kernel"] for r in rows} >= {"decode splits=1 shared", "merge shared", "shared prefix",
                                          "decode splits=2 direct shared", "merge direct shared",
                                          "decode splits=1 tile 64,4,5", "decode splits=1 shared tile 32,4,6",
                                          "rotary cache hq=32", "rotary cache hq=16 norm",
                                          "rotary cache hq=16 norm rotate_k"}
    for r in rows:
        assert "error" not in r and r["fits"] and r["stack_bytes"] == 0, r
    # the default tile (3 stages) keeps one K/V tile in shared memory; 5 stages at 64 keys, 6 at 32, keep two
    # (what bench/gpu_decode_sweep.py times on a GPU)
    buffers = {r["kernel"]: r["kv_buffers"] for r in rows if r["kernel"].startswith("decode")}
    assert buffers["decode splits=1"] == buffers["decode splits=1 shared"] == 1
    assert buffers["decode splits=1 tile 64,4,5"] == buffers["decode splits=1 shared tile 32,4,6"] == 2
