"""FP8 weights (``quantization="fp8"``, vLLM's flag): bf16/fp16 weights quantized at load to float8_e4m3fn.

Weights get one scale per output channel (row of W: ``amax(|W[o, :]|) / 448``), activations one scale per
token, computed at run time from the token's own ``amax`` (dynamic: no calibration data). A linear layer then
computes ``y[t, o] = s_x[t] * s_w[o] * sum_k q_x[t, k] * q_w[o, k]``: on CUDA, after the per-token
quantization kernel, either ``torch._scaled_mm`` with row-wise scales (FP8 tensor cores, compute capability >= 8.9:
Ada, Hopper; accumulation in float32, bf16 out) or, at small M (decode batches, where the layer is bound by
reading its weights and ``_scaled_mm``'s one CUTLASS tile is slower than bf16), our Triton kernel
(``kernels/fp8_gemm.py``): ``fp8_matmul_path`` chooses by M (``KVFLEET_FP8_SMALL_M_MAX``). Elsewhere the
same formula in float32 (`fp8_linear_reference`, what the CPU tests use; PyTorch 2.11's CPU ``_scaled_mm``
takes only one scale per tensor). The LM head and the embedding stay in the model dtype, as in
vLLM. Half the weight bytes: a decode step at small batch reads ~half as much, a prefill's matmuls run at the
FP8 rate.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

from kvfleet.engine.distributed.parallel_state import tp_all_reduce
from kvfleet.engine.kernels.fp8_quant import QuantizedActivation
from kvfleet.engine.models.linear import ColumnParallelLinear, RowParallelLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)   # 448
_MIN_SCALE = 1e-12   # an all-zero row or token gets this scale (its values quantize to 0 either way)
MIN_CAPABILITY = (8, 9)

SMALL_M_MAX_ENV = "KVFLEET_FP8_SMALL_M_MAX"   # M (tokens in the step) up to which the Triton kernel runs; 0: never
# Provisional, until the GPU sweep (bench/gpu_fp8_sweep.py) measures the crossover on the H200.
DEFAULT_SMALL_M_MAX = 64
FAST_ACCUM_ENV = "KVFLEET_FP8_FAST_ACCUM"      # 1: _scaled_mm(use_fast_accum=True) on the large-M path
FUSED_QUANT_ENV = "KVFLEET_FP8_FUSED_QUANT"    # 0: RMSNorm / SiLU-and-mul hand bf16 on, each linear quantizes

Fp8MatmulPath = Literal["triton", "scaled_mm"]


@dataclasses.dataclass(frozen=True)
class Fp8MatmulSettings:
    """How an Fp8Linear multiplies on CUDA: the Triton kernel up to ``small_m_max`` rows, ``torch._scaled_mm``
    above (with ``use_fast_accum`` if ``fast_accum``); ``fused_quant``: the RMSNorm and SiLU-and-mul kernels
    before qkv, gate_up and down quantize their output (one launch less per layer input)."""

    small_m_max: int = DEFAULT_SMALL_M_MAX
    fast_accum: bool = False
    fused_quant: bool = True


def parse_fp8_settings(env: Mapping[str, str]) -> Fp8MatmulSettings:
    """The settings from environment variables (a ValueError names the variable)."""
    raw = env.get(SMALL_M_MAX_ENV, "").strip()
    try:
        small_m_max = int(raw) if raw else DEFAULT_SMALL_M_MAX
    except ValueError:
        small_m_max = -1
    if small_m_max < 0:
        raise ValueError(f"{SMALL_M_MAX_ENV}: expected an integer >= 0 (0: always torch._scaled_mm), got {raw!r}")
    flags = {}
    for name, default in ((FAST_ACCUM_ENV, "0"), (FUSED_QUANT_ENV, "1")):
        flags[name] = env.get(name, default).strip()
        if flags[name] not in ("0", "1"):
            raise ValueError(f"{name}: expected 0 or 1, got {flags[name]!r}")
    return Fp8MatmulSettings(small_m_max=small_m_max, fast_accum=flags[FAST_ACCUM_ENV] == "1",
                             fused_quant=flags[FUSED_QUANT_ENV] == "1")


@functools.cache
def fp8_matmul_settings() -> Fp8MatmulSettings:
    """The process's settings, read from the environment once."""
    return parse_fp8_settings(os.environ)


def fp8_matmul_path(m: int, small_m_max: int) -> Fp8MatmulPath:
    """Which FP8 matmul runs a product of ``m`` rows. CUDA graphs capture decode at fixed batch sizes, so each
    captured size keeps one path."""
    return "triton" if m <= small_m_max else "scaled_mm"


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> (float8_e4m3fn ``[R, C]``, float32 scales ``[R, 1]``), ``x ~= q * scale`` row by row.

    The scale maps each row's largest magnitude to 448 (E4M3's largest finite value); values are rounded to
    the nearest representable E4M3 number (PyTorch's cast) after clamping, so nothing overflows to NaN."""
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (scale ``[R, 1]`` per row)."""
    return q.float() * scale


def fp8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the FP8 matmul computes, in float32 from the same quantized operands: ``x [T, K]`` quantized per
    token, ``w_q [N, K]`` with ``w_scale [N, 1]``; -> ``[T, N]`` in x's dtype."""
    x_q, x_scale = quantize_per_row(x)
    return fp8_matmul_reference(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def fp8_matmul_reference(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The float32 product of already-quantized activations -> ``[T, N]`` in ``dtype``."""
    y = (x_q.float() @ w_q.float().t()) * x_scale * w_scale.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def fp8_linear_cuda(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, settings: Fp8MatmulSettings | None = None) -> torch.Tensor:
    """The same on CUDA: per-token quantization (one fused kernel), then one FP8 GEMM with the scales in its
    epilogue: our Triton kernel at small M, ``torch._scaled_mm`` (row-wise) above (``fp8_matmul_path``)."""
    from kvfleet.engine.kernels.fp8_quant import per_token_quant_fp8

    x_q, x_scale = per_token_quant_fp8(x if x.stride(-1) == 1 else x.contiguous())
    return fp8_matmul_cuda(x_q, x_scale, w_q, w_scale, bias, x.dtype, settings or fp8_matmul_settings())


def fp8_matmul_cuda(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, dtype: torch.dtype, settings: Fp8MatmulSettings) -> torch.Tensor:
    """The GEMM of already-quantized activations (``x_q [M, K]``, ``x_scale [M, 1]``) -> ``[M, N]`` in
    ``dtype``."""
    out_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if fp8_matmul_path(x_q.shape[0], settings.small_m_max) == "triton":
        from kvfleet.engine.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype=out_dtype).to(dtype)
    # row-wise scales: scale_a [M, 1], scale_b [1, N] (float32); mat2 column-major: W [N, K] row-major, transposed.
    # K and N must be multiples of 16 (every model dimension we serve is), M is free.
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1),
                         out_dtype=out_dtype, bias=bias.to(out_dtype) if bias is not None else None,
                         use_fast_accum=settings.fast_accum)
    return y.to(dtype)


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(supported, why not): FP8 matmuls need a CUDA GPU of compute capability >= 8.9."""
    if device.type != "cuda":
        return False, (f"needs a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer); the engine runs on "
                       f"{device.type}, where PyTorch has no row-wise scaled FP8 matmul")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return False, (f"needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); {name} is "
                       f"{major}.{minor}, without FP8 tensor cores")
    return True, ""


def check_fp8_supported(device: torch.device) -> None:
    ok, why = fp8_supported(device)
    if not ok:
        raise ValueError(f"quantization: fp8 {why}")


class Fp8Linear(nn.Module):
    """Stands in for a (tensor-parallel) linear layer after quantization: same input and output, FP8 weights.

    ``reduce`` is the row-parallel layer's all-reduce of partial sums (applied before its bias, as there)."""

    weight: torch.Tensor          # float8_e4m3fn [out, in]
    weight_scale: torch.Tensor    # float32 [out, 1]

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, bias_after_reduce: bool = False,
                 use_cuda_kernel: bool | None = None, settings: Fp8MatmulSettings | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", w_q)
        self.register_buffer("weight_scale", w_scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.reduce = reduce
        self.bias_after_reduce = bias_after_reduce
        self.use_cuda_kernel = w_q.is_cuda if use_cuda_kernel is None else use_cuda_kernel
        self.settings = settings or fp8_matmul_settings()
        self.in_features, self.out_features = w_q.shape[1], w_q.shape[0]

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """``x [..., K]`` in the model dtype, or a QuantizedActivation ``[T, K]`` (from a fused RMSNorm or
        SiLU-and-mul kernel: no quantization launch here)."""
        inner_bias = None if self.bias_after_reduce else self.bias
        if isinstance(x, QuantizedActivation):
            shape = x.values.shape
            if self.use_cuda_kernel:
                y = fp8_matmul_cuda(x.values, x.scales, self.weight, self.weight_scale, inner_bias, x.dtype,
                                    self.settings)
            else:
                y = fp8_matmul_reference(x.values, x.scales, self.weight, self.weight_scale, inner_bias, x.dtype)
        else:
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            if self.use_cuda_kernel:
                y = fp8_linear_cuda(x2, self.weight, self.weight_scale, inner_bias, self.settings)
            else:
                y = fp8_linear_reference(x2, self.weight, self.weight_scale, inner_bias)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.bias_after_reduce and self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8_e4m3 per-channel, dynamic per-token"


def quantize_linear(layer: ColumnParallelLinear | RowParallelLinear | nn.Linear,
                    use_cuda_kernel: bool | None = None, settings: Fp8MatmulSettings | None = None) -> Fp8Linear:
    """An Fp8Linear equivalent to one of kvfleet's linear layers (models/linear.py) or an nn.Linear."""
    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear, nn.Linear)):
        raise ValueError(f"quantization: no FP8 form for {type(layer).__name__}")
    weight = layer.weight.data
    if weight.dim() != 2 or not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"quantization: cannot quantize a weight of dtype {weight.dtype} and shape "
                         f"{tuple(weight.shape)}")
    w_q, w_scale = quantize_per_row(weight)
    bias = layer.bias.data if layer.bias is not None else None
    if isinstance(layer, RowParallelLinear):
        return Fp8Linear(w_q, w_scale, bias, reduce=tp_all_reduce, bias_after_reduce=True,
                         use_cuda_kernel=use_cuda_kernel, settings=settings)
    return Fp8Linear(w_q, w_scale, bias, use_cuda_kernel=use_cuda_kernel, settings=settings)


@runtime_checkable
class FusesFp8ActivationQuant(Protocol):
    """A block whose RMSNorm / activation kernels can quantize their output for the Fp8Linear layers after them
    (``kernels.QuantizedActivation``); called once its linear layers are Fp8Linear."""

    def fuse_fp8_activation_quant(self) -> int:
        """Switch the fusion on; returns how many kernels now quantize."""
        ...


def quantize_model_fp8(model: nn.Module, use_cuda_kernel: bool | None = None,
                       settings: Fp8MatmulSettings | None = None) -> int:
    """Replace every linear layer of the decoder (not the LM head, not the embedding) by its Fp8Linear, in
    place; the bf16 weights are freed; with ``settings.fused_quant`` the blocks that can fuse the activation
    quantization into their RMSNorm / SiLU-and-mul kernels do (on CUDA). Returns the number of layers quantized."""
    settings = settings or fp8_matmul_settings()
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear))]
    for parent, name, child in todo:
        setattr(parent, name, quantize_linear(child, use_cuda_kernel, settings))
        del child
    if settings.fused_quant:
        for block in model.modules():
            if isinstance(block, FusesFp8ActivationQuant):
                block.fuse_fp8_activation_quant()
    if any(p.device.type == "cuda" for p in model.parameters()):
        torch.cuda.empty_cache()
    return len(todo)
