"""Per-token FP8 quantization fused into the RMSNorm and SiLU-and-mul kernels (FP8 models), against the unfused
path: the same kernel's model-dtype output quantized by ``per_token_quant_fp8`` (itself bit-identical to the
PyTorch reference, tests/engine_kernels/test_fp8_quant_kernel.py). Values and scales must be bit-identical: the fused
kernels quantize the same rounded values with the same arithmetic. Then the layers: an FP8 MLP and a norm feeding
an FP8 linear give the same output with the fusion on as off (the Triton path, interpreted on CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvfleet.engine.kernels.activation as act
from kvfleet.engine import kernels
from kvfleet.engine.kernels.fp8_quant import QuantizedActivation, per_token_quant_fp8
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.models import layers
from kvfleet.engine.models.fp8 import Fp8Linear, Fp8MatmulSettings, quantize_linear, quantize_model_fp8
from kvfleet.engine.models.linear import ColumnParallelLinear
from kvfleet.engine.models.llama import LlamaDecoderLayer


def _same(qa: QuantizedActivation, ref: torch.Tensor) -> None:
    q_ref, s_ref = per_token_quant_fp8(ref.reshape(-1, ref.shape[-1]))
    assert qa.values.dtype == torch.float8_e4m3fn and qa.values.shape == q_ref.shape
    assert qa.dtype == ref.dtype
    assert torch.equal(qa.scales, s_ref)
    assert torch.equal(qa.values.float(), q_ref.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (7, 200), (2, 3, 96)])
def test_rms_norm_quant_matches_norm_then_quant(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    res = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    _same(kernels.rms_norm_quant_fp8(x, w, 1e-6), kernels.rms_norm(x, w, 1e-6))
    qa, h = kernels.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6)
    normed, h_ref = kernels.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(h, h_ref)
    _same(qa, normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, inter", [(1, 64), (5, 200)])
def test_silu_and_mul_quant_matches_act_then_quant(dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    x[0, inter + 3] = 300.0   # an outlier in the up half sets row 0's scale
    _same(kernels.silu_and_mul_quant_fp8(x), kernels.silu_and_mul(x))


def test_silu_and_mul_quant_rows_wider_than_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(act, "_SINGLE_PASS_MAX", 128)
    monkeypatch.setattr(act, "_LOOP_BLOCK", 64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2 * 300, generator=g).to(torch.bfloat16)
    x[1, 299] = 40.0   # the largest product in the last, partial block of the gate half
    _same(kernels.silu_and_mul_quant_fp8(x), kernels.silu_and_mul(x))


def test_empty_and_bad_input() -> None:
    qa = kernels.silu_and_mul_quant_fp8(torch.zeros(0, 64))
    assert qa.values.shape == (0, 32) and qa.scales.shape == (0, 1)
    qa = kernels.rms_norm_quant_fp8(torch.zeros(0, 64), torch.ones(64), 1e-6)
    assert qa.values.shape == (0, 64)
    with pytest.raises(ValueError, match="x"):
        kernels.silu_and_mul_quant_fp8(torch.zeros(2, 63))
    with pytest.raises(ValueError, match="values"):
        QuantizedActivation(torch.zeros(2, 4), torch.ones(2, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        QuantizedActivation(torch.zeros(2, 4).to(torch.float8_e4m3fn), torch.ones(2), torch.bfloat16)


def _config(hidden: int, inter: int) -> ModelConfig:
    return ModelConfig(model="tiny", folder=Path("."), gguf_file=None, model_type="llama",
                       architecture="LlamaForCausalLM", hidden_size=hidden, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=hidden // 2, intermediate_size=inter, vocab_size=64, rope_theta=10000.0,
                       rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                       mlp_bias=False, qk_norm=False, max_model_len=64, eos_token_ids=[0], dtype=torch.bfloat16)


def _fp8_mlp(hidden: int, inter: int, fused: bool) -> LlamaDecoderLayer:
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(_config(hidden, inter), attention_fn=None).to(torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    quantize_model_fp8(layer, use_cuda_kernel=True, settings=Fp8MatmulSettings(small_m_max=512, fused_quant=fused))
    return layer


def test_layers_give_the_same_output_with_the_fusion_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' path (what CUDA runs), interpreted: norm + gate_up + SiLU-and-mul + down with the quantization
    fused or not. Same quantized operands -> the same output."""
    monkeypatch.setattr(layers, "_fused", lambda x: True)
    on, off = _fp8_mlp(64, 96, fused=True), _fp8_mlp(64, 96, fused=False)
    assert on.mlp.quant_fp8 and on.post_attention_layernorm.quant_fp8 and on.input_layernorm.quant_fp8
    assert not off.mlp.quant_fp8 and not off.post_attention_layernorm.quant_fp8
    g = torch.Generator().manual_seed(1)
    attn, resid = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    outs = []
    for layer in (on, off):
        normed, h = layer.post_attention_layernorm.add_and_norm(attn, resid)
        outs.append(h + layer.mlp(normed))
        assert isinstance(normed, QuantizedActivation) == (layer is on)
    assert torch.equal(outs[0], outs[1])
    # the input norm feeding the qkv layer
    qkv_on = on.self_attn.qkv_proj(on.input_layernorm(attn))
    qkv_off = off.self_attn.qkv_proj(off.input_layernorm(attn))
    assert torch.equal(qkv_on, qkv_off)


def test_fp8_linear_takes_a_quantized_activation_on_the_reference_path() -> None:
    g = torch.Generator().manual_seed(0)
    col = ColumnParallelLinear(64, [48], bias=True, tp_rank=0, tp_size=1)
    col.weight.data.normal_(0, 0.05, generator=g)
    col.bias.data.normal_(0, 0.1, generator=g)   # the layer allocates it uninitialized: a NaN there failed this test
    fp8 = quantize_linear(col, use_cuda_kernel=False)
    assert isinstance(fp8, Fp8Linear)
    x = torch.randn(6, 64, generator=g).bfloat16()
    q, s = per_token_quant_fp8(x)
    out = fp8(QuantizedActivation(q, s, x.dtype))
    assert torch.isfinite(out).all()
    assert torch.equal(out, fp8(x))


def test_the_fusion_needs_fp8_consumers() -> None:
    with pytest.raises(ValueError, match="FP8"):
        LlamaDecoderLayer(_config(32, 64), attention_fn=None).fuse_fp8_activation_quant()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_through_the_cuda_path_matches_the_reference_path(
        arch: str, tiny_model_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole tiny model (prefill of 3 prompts) the way CUDA runs it: the fused kernels, the quantization inside
    RMSNorm / SiLU-and-mul, the per-token quant kernel before o, and the Triton GEMM, interpreted on CPU; against
    the same model on the float32 reference FP8 path (no fusion). Same quantized operands and the same float32
    products: only the summation order differs, which can flip a rare bf16 rounding (and a tiny random model
    amplifies a flip: one bf16 ulp in one linear's output moved its logits by ~5 %). Measured: identical."""
    from kvfleet.engine.attention.metadata import build_attention_metadata
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine

    monkeypatch.setattr(layers, "_fused", lambda x: True)
    model = str(tiny_model_factory(arch))

    def engine(cuda_path: bool) -> LLMEngine:
        eng = LLMEngine(EngineConfig(model=model, dtype="bfloat16", device="cpu", num_kv_blocks=16,
                                     max_model_len=128))
        settings = Fp8MatmulSettings(small_m_max=1 << 20, fused_quant=cuda_path)
        quantize_model_fp8(eng.runner.executor.model, use_cuda_kernel=cuda_path, settings=settings)
        return eng

    def logits(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
        runner = eng.runner
        blocks = -(-len(ids) // runner.block_size)
        runner._allocate_kv(blocks)
        md = build_attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], runner.block_size, runner.device)
        with torch.inference_mode():
            hidden = runner.executor.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, md)
            return runner.executor.model.compute_logits(hidden).float()

    cuda, ref = engine(True), engine(False)
    layer0 = cuda.runner.executor.model.model.layers[0]
    assert layer0.mlp.quant_fp8 and layer0.input_layernorm.quant_fp8
    g = torch.Generator().manual_seed(4)
    exact = 0
    for n in (3, 17, 40):
        ids = torch.randint(3, cuda.model_config.vocab_size, (n,), generator=g).tolist()
        a, b = logits(cuda, ids), logits(ref, ids)
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 0.02, (n, rel)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9
        exact += int(torch.equal(a, b))
    assert exact >= 2   # bit-identical logits for most prompts
