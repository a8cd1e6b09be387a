"""The small-M FP8 GEMM (kernels/fp8_gemm.py) against the float32 reference of the same quantized operands.

Under Triton's CPU interpreter the kernel multiplies float32 copies of the E4M3 operands (which hold their values
exactly) in IEEE float32, so with a float32 output it must match ``(x_q @ w_q^T) * s_x * s_w + bias`` computed by
PyTorch to float32 rounding: this checks the tiling, the masks of partial M/N/K tiles, split-K and its reduction,
the scales and the bias. The GPU sweep (bench/gpu_fp8_sweep.py) checks the compiled FP8 dot on the H200.
"""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.kernels.fp8_gemm import FP8_DTYPE, Fp8GemmConfig, default_config, fp8_gemm, parse_config
from kvfleet.engine.models.fp8 import (
    Fp8Linear,
    Fp8MatmulSettings,
    fp8_linear_reference,
    fp8_matmul_path,
    parse_fp8_settings,
    quantize_per_row,
)


def _operands(m: int, n: int, k: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.05 * torch.logspace(-1, 1, n)[:, None]
    x_q, x_s = quantize_per_row(x)
    w_q, w_s = quantize_per_row(w)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, x_q, x_s, w_q, w_s, b


def _reference(x_q, x_s, w_q, w_s, b) -> torch.Tensor:
    y = (x_q.float() @ w_q.float().t()) * x_s * w_s.t()
    return y + b.float() if b is not None else y


CASES = [
    # m, n, k, config (None: the default heuristic)
    (1, 64, 256, None),
    (3, 96, 512, None),                                    # default at small N: split-K
    (5, 80, 300, Fp8GemmConfig(16, 32, 64, 3)),            # partial N tile, K not a multiple of BLOCK_K, 3 splits
    (17, 48, 128, Fp8GemmConfig(16, 32, 32, 1)),           # two M tiles, the second of one row; no split
    (33, 64, 256, Fp8GemmConfig(32, 32, 32, 5)),           # 8 K blocks over 5 splits: the last split is shorter
    (40, 128, 192, Fp8GemmConfig(64, 64, 64, 8)),          # more splits asked than K blocks: 3 used
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m, n, k, config", CASES)
def test_matches_the_float32_reference(m: int, n: int, k: int, config: Fp8GemmConfig | None, bias: bool) -> None:
    _, x_q, x_s, w_q, w_s, b = _operands(m, n, k, seed=m * 1000 + n + k, bias=bias)
    ref = _reference(x_q, x_s, w_q, w_s, b)
    got = fp8_gemm(x_q, x_s, w_q, w_s, b, out_dtype=torch.float32, config=config)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=2e-5, atol=1e-5 * ref.abs().max().item())
    # bf16 out: the float32 result rounded to nearest once (a value within float32 noise of a rounding boundary
    # may round the other way: one bf16 ulp, rarely)
    got16 = fp8_gemm(x_q, x_s, w_q, w_s, b, out_dtype=torch.bfloat16, config=config)
    assert got16.dtype == torch.bfloat16
    assert torch.allclose(got16.float(), ref, rtol=2.0**-7, atol=1e-6)
    assert (got16 != ref.to(torch.bfloat16)).float().mean().item() <= 0.01


def test_same_result_for_every_split() -> None:
    _, x_q, x_s, w_q, w_s, _ = _operands(4, 64, 512, seed=5)
    outs = [fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.float32, config=Fp8GemmConfig(16, 64, 64, s))
            for s in (1, 2, 4, 8)]
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], rtol=1e-5, atol=1e-6)


def test_a_whole_linear_layer_through_the_triton_path_matches_the_reference() -> None:
    """Fp8Linear's CUDA path (per-token quant kernel, then this kernel) run interpreted on CPU."""
    x, _, _, w_q, w_s, b = _operands(6, 96, 256, seed=7, bias=True)
    layer = Fp8Linear(w_q, w_s, b, use_cuda_kernel=True, settings=Fp8MatmulSettings(small_m_max=64))
    got = layer(x.reshape(2, 3, 256))
    ref = fp8_linear_reference(x, w_q, w_s, b).reshape(2, 3, 96)
    assert got.shape == ref.shape and got.dtype == x.dtype
    assert torch.allclose(got.float(), ref.float(), rtol=2.0**-7, atol=1e-6)


def test_empty_inputs() -> None:
    _, x_q, x_s, w_q, w_s, b = _operands(2, 32, 64, seed=9, bias=True)
    assert fp8_gemm(x_q[:0], x_s[:0], w_q, w_s).shape == (0, 32)
    y = fp8_gemm(x_q[:, :0], x_s, w_q[:, :0], w_s, b)   # K = 0: the bias alone
    assert torch.equal(y, b.expand(2, 32))


def test_default_config_fills_the_gpu_at_llama_8b_shapes() -> None:
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        for n, k in shapes.values():
            cfg = default_config(m, n, k, num_sms=132)
            assert cfg.block_m >= min(m, 16) and cfg.block_m <= max(16, 2 * m)
            tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
            k_blocks = -(-k // cfg.block_k)
            assert tiles * cfg.split_k >= 132 or k_blocks // cfg.split_k < 4   # full, or splits as short as allowed
            assert k_blocks // cfg.split_k >= 2
    assert default_config(1, 4096, 4096).split_k > 1 and default_config(1, 28672, 4096).split_k == 1


def test_config_parsing_and_validation() -> None:
    assert parse_config("16,64,256,4,4,4") == Fp8GemmConfig(16, 64, 256, 4, 4, 4)
    assert parse_config("16,64,256,4,4,4,128").imprecise_acc == 128
    assert Fp8GemmConfig(16, 64, 256, 4).label() == "m16n64k256s4w4p4"
    for bad in ("16,64", "a,b,c,d,e,f", "24,64,256,1,4,4", "16,64,256,0,4,4", "16,64,128,1,4,4,256"):
        with pytest.raises(ValueError):
            parse_config(bad)


def test_refuses_what_it_cannot_multiply() -> None:
    _, x_q, x_s, w_q, w_s, b = _operands(3, 32, 64, seed=11, bias=True)
    with pytest.raises(ValueError, match="a_q"):
        fp8_gemm(x_q.float(), x_s, w_q, w_s)
    with pytest.raises(ValueError, match="w_q"):
        fp8_gemm(x_q, x_s, w_q[:, :32], w_s)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(x_q, x_s[:2], w_q, w_s)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm(x_q, x_s, w_q, w_s.double())
    with pytest.raises(ValueError, match="bias"):
        fp8_gemm(x_q, x_s, w_q, w_s, b[:5])
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm(x_q, x_s, w_q, w_s, out_dtype=torch.int32)
    assert x_q.dtype == FP8_DTYPE


def test_path_by_m_and_settings_from_the_environment() -> None:
    assert fp8_matmul_path(1, 64) == "triton" and fp8_matmul_path(64, 64) == "triton"
    assert fp8_matmul_path(65, 64) == "scaled_mm" and fp8_matmul_path(1, 0) == "scaled_mm"
    assert parse_fp8_settings({}) == Fp8MatmulSettings()
    s = parse_fp8_settings({"KVFLEET_FP8_SMALL_M_MAX": "0", "KVFLEET_FP8_FAST_ACCUM": "1"})
    assert s == Fp8MatmulSettings(small_m_max=0, fast_accum=True)
    with pytest.raises(ValueError, match="KVFLEET_FP8_SMALL_M_MAX"):
        parse_fp8_settings({"KVFLEET_FP8_SMALL_M_MAX": "-1"})
    with pytest.raises(ValueError, match="KVFLEET_FP8_SMALL_M_MAX"):
        parse_fp8_settings({"KVFLEET_FP8_SMALL_M_MAX": "many"})
    with pytest.raises(ValueError, match="KVFLEET_FP8_FAST_ACCUM"):
        parse_fp8_settings({"KVFLEET_FP8_FAST_ACCUM": "yes"})
