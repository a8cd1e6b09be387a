"""bench/gpu_step_profile.py and bench/kernel_kinds.py: kernels of both engines sorted into the same kinds, and the
CPU dry run of the step profile end to end (the GPU run differs only in its device and sizes)."""

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from kvfleet.engine.testing import make_tiny_model

# names as torch.profiler reported them on the H200 (ours: bench/results/issue16/lease12/profile) and vLLM's kernels
KERNELS = {
    "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "gemm",
    "_small_m_gemm_kernel": "gemm",
    "_fp8_gemm_kernel": "gemm",
    "_prefill_kernel_v2": "attention",
    "_prefill_gluon_kernel": "attention",
    "_decode_kernel": "attention",
    "_merge_kernel": "attention",
    "_shared_prefix_kernel": "attention",
    "void flash::FlashAttnFwdSm90<cutlass::bfloat16_t>": "attention",   # a cutlass template, not a GEMM
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>": "attention",
    "_rms_norm_kernel": "norm",
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>": "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "_silu_mul_kernel": "activation",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>": "activation",
    "_rotary_cache_kernel": "rope + kv write",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>": "rope + kv write",
    "_per_token_quant_kernel": "fp8 quant",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>": "sampling",
    "_apply_token_bitmask_kernel": "sampling",
    "Memset (Device)": "copies",
    "Memcpy HtoD (Pinned -> Device)": "copies",
    "void at::native::vectorized_gather_kernel<16, long>": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>>": "other",
}


def test_kernel_kinds_of_both_engines(bench_module: Callable[[str], Any]) -> None:
    kinds = bench_module("kernel_kinds")
    assert {name: kinds.kernel_kind(name) for name in KERNELS} == KERNELS


def test_kind_rows_compare_and_total(bench_module: Callable[[str], Any]) -> None:
    kinds = bench_module("kernel_kinds")
    rows = kinds.kind_rows({"gemm": 10.0, "attention": 3.0, "norm": 0.0}, {"gemm": 8.0, "attention": 4.0})
    by = {r["kind"]: r for r in rows}
    assert set(by) == {"gemm", "attention", "total"}     # a kind neither engine ran is left out
    assert by["gemm"]["diff_ms"] == pytest.approx(2.0) and by["gemm"]["ratio"] == pytest.approx(1.25)
    assert by["total"]["ours_ms"] == pytest.approx(13.0) and by["total"]["ratio"] == pytest.approx(13 / 12)
    assert kinds.kind_rows({"norm": 1.0}, {})[0]["ratio"] is None


def test_step_profile_dry_run_and_compare(tmp_path: Path, bench_module: Callable[[str], Any]) -> None:
    module = bench_module("gpu_step_profile")
    model = make_tiny_model("llama", tmp_path / "model")
    out = tmp_path / "out"
    assert module.main(["run", "--engine", "kvfleet", "--model", str(model), "--out", str(out), "--dry",
                        "--scenarios", "prefill-8x1024,burst,burst-prefill,long-prompts", "--repeats", "2"]) == 0
    res = json.loads((out / "step_profile_kvfleet.json").read_text())
    assert set(res["scenarios"]) == {"prefill-8x1024", "burst", "burst-prefill", "long-prompts"}
    burst = res["scenarios"]["burst"]
    assert burst["output_tokens"] == 16 * 4 and len(burst["wall_ms"]) == 2   # dry sizes: 16 prompts x 4 tokens
    assert res["scenarios"]["burst-prefill"]["output_tokens"] == 16
    for sc in res["scenarios"].values():
        by_kind = sc["kernel_ms_by_kind"]
        assert sum(by_kind.values()) == pytest.approx(sc["kernel_ms_total"])
        assert by_kind["gemm"] > 0 and by_kind["attention"] > 0
        assert any(k["name"] == "aten::mm" and k["kind"] == "gemm" for k in sc["top_kernels"])
        for k in sc["top_kernels"]:   # each kernel's calls: the median and p90 of one call, within its total
            # (the total went through ms and back: a kernel of one call has p90 == total but for the last bit)
            assert 0 < k["median_us"] <= k["p90_us"] <= k["ms"] * 1e3 * (1 + 1e-9)
            assert k["median_us"] * k["calls"] <= 2 * k["ms"] * 1e3 + 1e-6   # half its calls take the median or more
    # the comparison needs both engines' results
    assert module.main(["compare", str(out)]) == 2
    theirs = {**res, "engine": "vllm",
              "scenarios": {"burst": {**burst, "wall_ms_median": burst["wall_ms_median"] / 2},
                            "burst-prefill": res["scenarios"]["burst-prefill"]}}
    (out / "step_profile_vllm.json").write_text(json.dumps(theirs))
    assert module.main(["compare", str(out)]) == 0
    cmp = json.loads((out / "step_profile_compare.json").read_text())
    decoding = "burst decoding (burst less burst-prefill)"
    assert set(cmp) == {"burst", "burst-prefill", decoding} and cmp["burst"]["wall_ms"]["ratio"] == pytest.approx(2.0)
    total = {r["kind"]: r for r in cmp[decoding]["kinds"]}["total"]
    assert total["ours_ms"] == pytest.approx(burst["kernel_ms_total"]
                                             - res["scenarios"]["burst-prefill"]["kernel_ms_total"])
    text = (out / "step_profile_compare.txt").read_text()
    assert "## burst:" in text and f"## {decoding}" in text


def test_step_profile_rejects_unknown_scenario(bench_module: Callable[[str], Any], tmp_path: Path) -> None:
    module = bench_module("gpu_step_profile")
    with pytest.raises(SystemExit):
        module.main(["run", "--engine", "kvfleet", "--model", "m", "--out", str(tmp_path), "--scenarios", "bogus"])
