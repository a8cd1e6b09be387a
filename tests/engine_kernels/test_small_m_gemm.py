"""The small-M bf16/fp16 GEMM (kernels/small_m_gemm.py) against a float32 PyTorch reference, its tiling heuristic,
and the switch that routes the model's linear layers to it (models/small_m_linear.py).

Under Triton's CPU interpreter: with float32 inputs the kernel must match ``x @ w^T + bias`` to float32 rounding
(this checks the tiling, the masks of partial N/K tiles, both multiply modes, split-K and its reduction, the bias);
with bf16 inputs the float32 result rounded once to bf16 (the interpreter truncates, so the wrapper rounds in
PyTorch, as on the GPU). The GPU sweep (bench/gpu_small_m_gemm_sweep.py) times it against cuBLAS on the H200.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvfleet.engine.kernels import small_m_gemm as small_m_gemm_module
from kvfleet.engine.kernels.small_m_gemm import SmallMGemmConfig, default_small_m_config, small_m_gemm
from kvfleet.engine.models import small_m_linear
from kvfleet.engine.models.small_m_linear import SmallMGemmSettings, linear, linear_path, parse_small_m_gemm_settings

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}   # N, K
QWEN3_06B = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
             "lm_head": (151936, 1024)}


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return y + b.float() if b is not None else y


CASES = [
    # m, n, k, config (None: the default heuristic)
    (1, 40, 200, None),                                                 # partial N tile, K short of one tile
    (2, 72, 520, SmallMGemmConfig(8, 64, 1)),                           # elementwise, N and K not tile multiples
    (3, 40, 300, SmallMGemmConfig(8, 64, 3)),                           # elementwise, 3 splits, a short last one
    (16, 48, 1100, None),                                               # the dot by default (M > 2), split-K
    (3, 80, 200, SmallMGemmConfig(16, 32, 4, use_dot=True)),            # dot, partial tiles, 4 splits of 2 blocks
    (16, 64, 96, SmallMGemmConfig(32, 32, 1, num_stages=1, use_dot=True)),   # dot, plain loads, partial K
    (1, 64, 256, SmallMGemmConfig(16, 64, 8, num_stages=1)),            # elementwise, plain loads, more splits
    (16, 24, 128, SmallMGemmConfig(8, 32, 2)),                          # elementwise at 16 rows
    (1, 40, 200, SmallMGemmConfig(16, 64, 1, x_vector=True)),           # x rows as vectors, partial N and K
    (3, 72, 520, SmallMGemmConfig(8, 64, 3, x_vector=True)),            # ... 3 rows, 3 splits
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m, n, k, config", CASES, ids=lambda v: v.label() if isinstance(v, SmallMGemmConfig) else None)
def test_matches_the_float32_reference(m: int, n: int, k: int, config: SmallMGemmConfig | None, bias: bool,
                                       dtype: torch.dtype) -> None:
    x, w, b = _operands(m, n, k, dtype, seed=m * 1000 + n + k, bias=bias)
    ref = _reference(x, w, b)
    got = small_m_gemm(x, w, b, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-5 * ref.abs().max().item())
    else:
        # the float32 sum rounded to nearest once (a value within float32 noise of a rounding boundary may round
        # the other way: one bf16 ulp, rarely)
        torch.testing.assert_close(got.float(), ref, rtol=2.0**-7, atol=1e-6)
        assert (got != ref.to(dtype)).float().mean().item() <= 0.02


def test_default_config_splits_where_the_case_expects() -> None:
    assert default_small_m_config(16, 48, 1100).split_k > 1 and not default_small_m_config(1, 40, 200).use_dot


def test_fp16_matches_the_reference() -> None:
    x, w, b = _operands(4, 56, 136, torch.float16, seed=3, bias=True)
    got = small_m_gemm(x, w, b)
    torch.testing.assert_close(got.float(), _reference(x, w, b), rtol=2.0**-10, atol=1e-4)


@pytest.mark.parametrize("use_dot", [False, True])
def test_same_result_for_every_split(use_dot: bool) -> None:
    x, w, _ = _operands(4, 32, 512, torch.float32, seed=5, bias=False)
    outs = [small_m_gemm(x, w, config=SmallMGemmConfig(16, 64, s, use_dot=use_dot)) for s in (1, 2, 4, 8)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-6)
    again = small_m_gemm(x, w, config=SmallMGemmConfig(16, 64, 4, use_dot=use_dot))
    assert torch.equal(again, outs[2])   # deterministic: a fixed order of the partial sums


def test_empty_inputs() -> None:
    x, w, b = _operands(2, 32, 64, torch.float32, seed=9, bias=True)
    assert small_m_gemm(x[:0], w).shape == (0, 32)
    assert small_m_gemm(x, w[:0], b[:0]).shape == (2, 0)
    assert torch.equal(small_m_gemm(x[:, :0], w[:, :0], b), b.expand(2, 32))   # K = 0: the bias alone
    assert torch.equal(small_m_gemm(x[:, :0], w[:, :0]), torch.zeros(2, 32))


def test_refuses_what_it_cannot_multiply() -> None:
    x, w, b = _operands(3, 32, 64, torch.bfloat16, seed=11, bias=True)
    with pytest.raises(ValueError, match="x"):
        small_m_gemm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="x"):
        small_m_gemm(x[None], w)
    with pytest.raises(ValueError, match="x: 17 rows"):
        small_m_gemm(torch.zeros(17, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="x"):
        small_m_gemm(x.t().contiguous().t(), w)   # K not contiguous
    with pytest.raises(ValueError, match="w"):
        small_m_gemm(x, w.float())
    with pytest.raises(ValueError, match="w"):
        small_m_gemm(x, w[:, :32])
    with pytest.raises(ValueError, match="bias"):
        small_m_gemm(x, w, b[:5])
    with pytest.raises(ValueError, match="bias"):
        small_m_gemm(x, w, torch.ones(32, dtype=torch.int32))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="^x_vector:"):
        SmallMGemmConfig(16, 64, use_dot=True, x_vector=True)
    assert SmallMGemmConfig(8, 512).label() == "ewn8k512s1w4p3"
    assert SmallMGemmConfig(64, 128, 2, 8, 4, use_dot=True).label() == "dotn64k128s2w8p4"
    for kwargs, name in [(dict(block_n=12, block_k=64), "block_n"), (dict(block_n=8, block_k=64, use_dot=True),
                                                                      "block_n"),
                         (dict(block_n=8, block_k=8), "block_k"), (dict(block_n=8, block_k=2048), "block_k"),
                         (dict(block_n=8, block_k=64, split_k=0), "split_k"),
                         (dict(block_n=8, block_k=64, num_warps=3), "num_warps"),
                         (dict(block_n=8, block_k=64, num_stages=0), "num_stages")]:
        with pytest.raises(ValueError, match=name):
            SmallMGemmConfig(**kwargs)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="m"):
        default_small_m_config(17, 4096, 4096)


def _programs(cfg: SmallMGemmConfig, n: int) -> int:
    return -(-n // cfg.block_n) * cfg.split_k


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_default_config_fills_an_h200_at_llama_8b_shapes(m: int) -> None:
    for n, k in LLAMA_8B.values():
        cfg = default_small_m_config(m, n, k, num_sms=132)
        assert cfg.use_dot == (m > 2)
        assert _programs(cfg, n) >= 2 * 132, (m, n, k, cfg)
        smallest = 16 if cfg.use_dot else 8
        # split-K only where even the narrowest tile leaves too few programs (o and down under the dot)
        assert (cfg.split_k > 1) == (-(-n // smallest) < 2 * 132), (m, n, k, cfg)
        assert -(-k // cfg.block_k) // cfg.split_k >= 2
        assert cfg.block_n * cfg.block_k * 2 >= 8192   # at least 8 KB of weights per K step
    assert default_small_m_config(1, 4096, 4096).block_n == 8
    assert default_small_m_config(1, 128256, 4096).block_n == 32


def test_default_config_splits_k_for_small_n() -> None:
    for m in (1, 16):
        o = default_small_m_config(m, *QWEN3_06B["o"], num_sms=132)   # N = 1024, K = 2048
        k_steps = -(-2048 // o.block_k)
        # as many splits as it takes to fill the GPU, or as two K steps a split allow
        assert o.split_k > 1 and (_programs(o, 1024) >= 2 * 132 or k_steps // (2 * o.split_k) < 2)
        head = default_small_m_config(m, *QWEN3_06B["lm_head"], num_sms=132)
        assert head.split_k == 1
    # a tensor-parallel shard of 8: down is 4096 x 1792; short K keeps at least two K steps a split
    shard = default_small_m_config(16, 4096, 1792, num_sms=132)
    assert shard.split_k == 2 and -(-1792 // shard.block_k) // shard.split_k >= 2
    tiny = default_small_m_config(1, 64, 48, num_sms=132)
    assert tiny.block_k == 64 and tiny.split_k == 1   # one K step: nothing to split


def test_settings_from_the_environment() -> None:
    assert parse_small_m_gemm_settings({}) == SmallMGemmSettings(max_m=1)   # batch-1 products by default
    assert parse_small_m_gemm_settings({"KVFLEET_SMALL_M_GEMM_MAX": "0"}).max_m == 0
    assert parse_small_m_gemm_settings({"KVFLEET_SMALL_M_GEMM_MAX": " 8 "}).max_m == 8
    assert parse_small_m_gemm_settings({"KVFLEET_SMALL_M_GEMM_MAX": "16"}).max_m == 16
    assert parse_small_m_gemm_settings({"KVFLEET_SMALL_M_GEMM_MAX": ""}).max_m == 1
    for bad in ("-1", "17", "many", "1.5"):
        with pytest.raises(ValueError, match="KVFLEET_SMALL_M_GEMM_MAX"):
            parse_small_m_gemm_settings({"KVFLEET_SMALL_M_GEMM_MAX": bad})


def test_path_by_rows_dtype_and_device() -> None:
    bf16, fp16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert linear_path(1, bf16, bf16, "cuda", True, 4) == "triton"
    assert linear_path(4, fp16, fp16, "cuda", True, 4) == "triton"
    assert linear_path(5, bf16, bf16, "cuda", True, 4) == "torch"     # above the setting: cuBLAS
    assert linear_path(0, bf16, bf16, "cuda", True, 4) == "torch"
    assert linear_path(1, bf16, bf16, "cuda", True, 0) == "torch"     # off
    assert linear_path(1, bf16, bf16, "cpu", True, 4) == "torch"
    assert linear_path(1, f32, f32, "cuda", True, 4) == "torch"
    assert linear_path(1, bf16, fp16, "cuda", True, 4) == "torch"
    assert linear_path(1, bf16, bf16, "cuda", False, 4) == "torch"


def test_linear_on_cpu_is_f_linear_with_the_setting_on() -> None:
    x, w, b = _operands(3, 24, 40, torch.bfloat16, seed=13, bias=True)
    on = SmallMGemmSettings(max_m=16)
    assert torch.equal(linear(x, w, b, on), F.linear(x, w, b))
    assert torch.equal(linear(x[None], w, None, on), F.linear(x[None], w))


def test_linear_on_the_triton_path_matches_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper's reshape and dispatch, the kernel interpreted on CPU (the path is CUDA-only otherwise)."""
    calls: list[int] = []

    def anywhere(rows: int, *args: Any) -> str:
        calls.append(rows)
        return "triton" if 1 <= rows <= args[-1] else "torch"

    monkeypatch.setattr(small_m_linear, "linear_path", anywhere)
    x, w, b = _operands(6, 48, 64, torch.float32, seed=17, bias=True)
    got = linear(x.reshape(2, 3, 64), w, b, SmallMGemmSettings(max_m=8))
    torch.testing.assert_close(got, F.linear(x, w, b).reshape(2, 3, 48), rtol=2e-5, atol=1e-5)
    assert calls == [6]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_tiny_model_on_the_kernel_matches_transformers(arch: str, tiny_model_factory: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear layer and the LM head of a step of <= 16 rows on the kernel (interpreted; float32 weights):
    a prefill of 20 tokens on cuBLAS's stand-in, chunks of 12 (dot) and 2 (elementwise), then 2 decode steps.
    Tiled for a GPU of one SM: wide tiles, few programs to interpret."""
    import transformers

    from kvfleet.engine.attention import build_attention_metadata
    from kvfleet.engine.model_config import ModelConfig
    from kvfleet.engine.model_loader import load_model

    rows_on_kernel: list[int] = []

    def anywhere(rows: int, *args: Any) -> str:
        if 1 <= rows <= args[-1]:
            rows_on_kernel.append(rows)
            return "triton"
        return "torch"

    monkeypatch.setattr(small_m_linear, "linear_path", anywhere)
    monkeypatch.setattr(small_m_linear, "small_m_gemm_settings", lambda: SmallMGemmSettings(max_m=16))
    monkeypatch.setattr(small_m_gemm_module, "num_sms", lambda device: 1)
    folder = tiny_model_factory(arch)
    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(cfg, device="cpu")
    tokens = torch.randint(3, cfg.vocab_size, (36,), generator=torch.Generator().manual_seed(2)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    caches = [torch.zeros(2, 4, 16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    table = [2, 0, 3]
    got = []
    for start, end in [(0, 20), (20, 32), (32, 34), (34, 35), (35, 36)]:
        md = build_attention_metadata([end - start], [end], [table], 16)
        with torch.no_grad():
            hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches, md)
            got.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)
    assert set(rows_on_kernel) == {12, 2, 1}


def test_a_bad_setting_fails_at_model_load(monkeypatch: pytest.MonkeyPatch, tiny_model_factory: Any) -> None:
    """KVFLEET_SMALL_M_GEMM_MAX out of range stops the load with the variable's name, before any forward."""
    from kvfleet.engine.model_config import ModelConfig
    from kvfleet.engine.model_loader import load_model
    from kvfleet.engine.models import small_m_linear

    monkeypatch.setenv("KVFLEET_SMALL_M_GEMM_MAX", "17")
    small_m_linear.small_m_gemm_settings.cache_clear()
    try:
        with pytest.raises(ValueError, match="KVFLEET_SMALL_M_GEMM_MAX"):
            load_model(ModelConfig.from_pretrained(tiny_model_factory("llama")), device="cpu")
    finally:
        monkeypatch.delenv("KVFLEET_SMALL_M_GEMM_MAX")
        small_m_linear.small_m_gemm_settings.cache_clear()
