"""The Gluon FA3-style prefill kernel compiles for Hopper (sm_90) on this CPU, and its checks reject what it does not
support.

Gluon kernels cannot run under Triton's interpreter (``gluon.jit`` always builds a compiled kernel; on a machine
without a GPU its launch fails with "0 active drivers"), so there is no numerical test here: correctness is checked
on the GPU (``bench/gpu_gluon_attention_check.py``). What the CPU can check is what only the compiler sees: the
kernel compiles, does not spill, fits in an H200's shared memory, and its key loop issues its MMAs asynchronously
with the softmax's exponentials scheduled under them (ptxas keeps the order, no wgmma serialized).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfleet.engine.kernels.prefill_attention_gluon import (
    FA3_CHUNK_TILE,
    FA3_TILE,
    GluonTile,
    check_tile,
    engine_tiles,
    named_tile,
    paged_applies,
    prefill_attention_gluon,
    prefill_attention_gluon_paged,
)

ROOT = Path(__file__).resolve().parents[2]
HOPPER_MAX_SHARED = 232448


def test_gluon_kernel_compiles_for_sm90_with_softmax_under_the_mmas(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")   # compile, do not reuse
    out = tmp_path / "resources.json"
    # the default (FlashAttention-3's order, 128 x 128), the S-ahead schedule at its default 64-key tile, and the
    # warp-specialized variant of each; then the paged form the engine runs on chunks (warp-specialized)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gluon_attention_resources.py"),
                           "fa3,128,128,2,8", "ahead,128,64,2,8", "fa3-ws,128,128,2,8", "ahead-ws,128,64,2,8",
                           "fa3-ws-paged,128,128,2,8", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 5 and not [r for r in rows if "error" in r], rows
    paged = rows.pop()
    for r in rows + [paged]:
        assert r["stack_bytes"] == 0 and r["shared_bytes"] <= HOPPER_MAX_SHARED and r["fits"], r
        assert r["ptx_wgmma"] and not r["serialized"], r
        # every key loop (unmasked, diagonal) starts its softmax with an MMA in flight
        assert len(r["ptx_loops"]) == 2 and r["ptx_softmax_under_mma"], r
    fa3, ahead, fa3_ws, ahead_ws = rows
    # the producer warp takes the block-table loads and the eight copies a tile: the consumer's loops have the fresh
    # kernel's registers and CTA barriers (ptxas schedules the diagonal's softmax a little differently)
    assert paged["registers"] == fa3_ws["registers"], paged
    assert [o["bar_sync"] for o in paged["sass_loops"]] == [o["bar_sync"] for o in fa3_ws["sass_loops"]], paged
    # FlashAttention-3's order: P_{j-1} V_{j-1} (RS) under softmax(S_j); S-ahead: Q K_{j+1}^T (SS) too
    assert all(o["in_flight_at_first_ex2"] == ["RS"] for o in fa3["ptx_loops"] + fa3_ws["ptx_loops"]), fa3
    assert ahead["ptx_s_next_before_ex2"] and ahead_ws["ptx_s_next_before_ex2"], ahead
    # ptxas keeps most of the exponentials under an HGMMA group (it does not for fa3-ws: it hoists the wait for
    # P_{j-1} V_{j-1} above most of the softmax, to pack P_j into P_{j-1}'s registers)
    for r in (fa3, ahead, ahead_ws):
        assert r["sass_loops"] and all(o["ex2_under_mma"] * 4 > o["ex2"] * 3 for o in r["sass_loops"]), r


def test_gluon_two_consumer_variants_compile_for_sm90(tmp_path: Path) -> None:
    """Two consumer warpgroups (a partition each, 64 query rows) and a producer warp, taking turns at their MMAs
    (``fa3-pp``, FlashAttention-3's ping-pong) or not (``ahead-ws2``), fresh and paged (and with the producer loading a
    tile's block numbers at once): each compiles without a
    spill or a serialized wgmma, and each consumer runs its own key loops with the softmax issued under an MMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "resources.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gluon_attention_resources.py"),
                           "fa3-pp,128,128,2,8", "fa3-pp-paged,128,128,2,8", "ahead-ws2,128,64,2,8",
                           "fa3-ws2-paged-at-once,128,128,2,8", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and not [r for r in rows if "error" in r], rows
    for r in rows:
        assert r["stack_bytes"] == 0 and r["fits"] and r["ptx_wgmma"] and not r["serialized"], r
        # two consumers, an unmasked and a diagonal loop each (the outer dispatch loop of the workers not counted)
        assert len(r["sass_loops"]) == 4, r
        assert r["ptx_loops"] and r["ptx_softmax_under_mma"], r
    ahead = rows[2]
    # the block numbers loaded at once: the consumers' loops are the two-consumer paged kernel's
    assert [o["bar_sync"] for o in rows[3]["sass_loops"]] == [3, 3, 3, 3], rows[3]
    assert all(o["ex2_under_mma"] * 4 > o["ex2"] * 3 for o in ahead["sass_loops"]), ahead


def test_named_tiles_and_their_checks() -> None:
    pp = named_tile("fa3-pp")
    assert (pp.consumers, pp.pingpong, pp.warp_specialize, pp.s_ahead, pp.block_n) == (2, True, True, False, 128)
    ws2 = named_tile("ahead-ws2")
    assert (ws2.consumers, ws2.pingpong, ws2.s_ahead, ws2.block_n) == (2, False, True, 64)
    assert named_tile("fa3") == GluonTile()
    with pytest.raises(ValueError, match="^schedule: expected one of"):
        named_tile("ahead-pp")
    check_tile(128, 128, 2, 8, 128, warp_specialize=True, consumers=2, pingpong=True)
    with pytest.raises(ValueError, match="^consumers: 2 consumer warpgroups need warp_specialize"):
        check_tile(128, 128, 2, 8, 128, consumers=2)
    with pytest.raises(ValueError, match="^consumers: 2 consumer warpgroups need .* block_m 128"):
        check_tile(64, 128, 2, 8, 128, warp_specialize=True, consumers=2)
    with pytest.raises(ValueError, match="^consumers: must be 1 or 2"):
        check_tile(128, 128, 2, 8, 128, warp_specialize=True, consumers=3)
    with pytest.raises(ValueError, match="^pingpong: the MMAs in turns need 2 consumers"):
        check_tile(128, 128, 2, 8, 128, warp_specialize=True, pingpong=True)
    with pytest.raises(ValueError, match="^pingpong: .*s_ahead off"):
        check_tile(128, 64, 2, 8, 128, warp_specialize=True, consumers=2, pingpong=True, s_ahead=True)
    with pytest.raises(ValueError, match="^pages_at_once: .* needs warp_specialize"):
        check_tile(128, 128, 2, 8, 128, pages_at_once=True)
    assert engine_tiles("fa3") == (FA3_TILE, FA3_CHUNK_TILE)
    assert engine_tiles("pingpong") == (pp, pp)
    assert engine_tiles("two-warpgroups") == (named_tile("fa3-ws2"),) * 2
    assert engine_tiles("two-warpgroups", pages_at_once=True) == (
        named_tile("fa3-ws2"), dataclasses.replace(named_tile("fa3-ws2"), pages_at_once=True))
    with pytest.raises(ValueError, match="expected one of two-warpgroups, pingpong, fa3"):
        engine_tiles("ping-pong")


def _tensors(d: int = 128) -> dict[str, torch.Tensor]:
    """A fused qkv projection's q/k/v views (Llama-3.1-8B's heads), one 16-token prompt, on CPU."""
    qkv = torch.zeros(16, 32 + 2 * 8, d, dtype=torch.bfloat16)
    return {"q": qkv[:, :32], "k": qkv[:, 32:40], "v": qkv[:, 40:],
            "query_start_loc": torch.tensor([0, 16], dtype=torch.int32),
            "out": torch.empty(16, 32, d, dtype=torch.bfloat16)}


def _call(**kw: torch.Tensor) -> None:
    t = _tensors() | kw
    prefill_attention_gluon(t["q"], t["k"], t["v"], t["query_start_loc"], 16, 0.1, t["out"])


def test_gluon_paged_checks_name_what_they_refuse() -> None:
    cache = torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16)
    assert paged_applies(cache, 128) and paged_applies(cache, 64)
    assert not paged_applies(torch.zeros(2, 4, 128, 8, 128, dtype=torch.bfloat16), 128)   # a block a tile: v2's TMA
    assert not paged_applies(torch.zeros(2, 4, 12, 8, 128, dtype=torch.bfloat16), 128)    # not dividing the tile
    assert not paged_applies(cache.float(), 128)
    assert not paged_applies(cache.transpose(3, 2), 128)                                  # heads not in a row
    t = _tensors()
    with pytest.raises(ValueError, match="^q: on cpu: .*CUDA device only"):
        prefill_attention_gluon_paged(t["q"], cache, torch.zeros(1, 1, dtype=torch.int32),
                                      torch.tensor([16], dtype=torch.int32), t["query_start_loc"], 16, 0.1, t["out"],
                                      work=torch.zeros(1, 2, dtype=torch.int32))


def test_gluon_wrapper_rejects_unsupported_inputs() -> None:
    with pytest.raises(ValueError, match="^q: on cpu: .*CUDA device only"):
        _call()   # valid arguments, but on CPU: Gluon has no interpreter path
    with pytest.raises(ValueError, match="^q: dtype"):
        _call(q=torch.zeros(16, 32, 128))
    with pytest.raises(ValueError, match="^k: dtype"):
        _call(k=torch.zeros(16, 8, 128))
    with pytest.raises(ValueError, match="^q: head dim 96"):
        _call(**_tensors(d=96))
    with pytest.raises(ValueError, match=r"^v: needs strides \(\*, 128, 1\)"):
        _call(v=torch.zeros(16, 8, 256, dtype=torch.bfloat16)[:, :, :128])   # heads not packed in a row
    with pytest.raises(ValueError, match="^k: innermost stride"):
        _call(k=torch.zeros(16, 128, 8, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="^num_warps"):
        check_tile(128, 128, 2, 2, 128)
    with pytest.raises(ValueError, match="^block_m"):
        check_tile(32, 128, 2, 4, 128)
    with pytest.raises(ValueError, match="^block_n"):
        check_tile(128, 96, 2, 8, 128)
    with pytest.raises(ValueError, match="^num_buffers"):
        check_tile(128, 128, 4, 8, 128)   # 4 K and 4 V buffers of 32 KiB: more shared memory than an H200 has
    check_tile(128, 128, 3, 8, 128)
