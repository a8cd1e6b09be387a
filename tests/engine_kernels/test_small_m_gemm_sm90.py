"""The small-M bf16 GEMM compiled for Hopper (sm_90) with Triton's real compiler and ptxas, on this CPU
(bench/small_m_gemm_resources.py): the default tile of every Llama-3.1-8B shape at 1 and 16 rows (the elementwise
and the dot mode) compiles without spilling registers, fits an H200's shared memory, and loads its weights as
16-byte vectors (the kernel is a read of the weights: byte-wide or 2-byte loads would waste the point of it; only
an x row loaded as a vector may be narrow).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_default_tiles_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")   # compile, do not reuse
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "small_m_gemm_resources.py"), "--m", "1,16",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    gemms = [r for r in rows if "shape" in r]
    assert {(r["shape"], r["M"]) for r in gemms} == {(s, m) for s in ("qkv", "o", "gate_up", "down", "lm_head")
                                                     for m in (1, 16)}
    assert any(r.get("kernel") == "split-K sum" for r in rows)
    for r in rows:
        assert "error" not in r and r["fits"] and r["stack_bytes"] == 0, r
        # the weights never load narrow; x rows loaded as vectors (``ewv``) may: an x row is BLOCK_K elements
        # over the program's threads (gate_up's 128 over 128: one bf16 each), from L1, one load a row
        x_rows = r["M"] if str(r.get("config", "")).startswith("ewv") else 0
        assert r["ld_global_narrow"] <= x_rows, r
    for r in gemms:
        assert r["programs"] >= 2 * 132, r
        assert r["cp_async16"] > 0, r   # the default configs pipeline 16-byte copies
        assert r["mma"] == r["config"].startswith("dot"), r
