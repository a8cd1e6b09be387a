"""FP8 (E4M3) GEMM for small M, where a linear layer is bound by reading its weights: ``w8a8``.

``out[m, n] = a_scale[m] * w_scale[n] * sum_k a_q[m, k] * w_q[n, k] (+ bias[n])``: activations quantized per
token (``kernels/fp8_quant.py``), weights per output channel (``models/fp8.py``), float32 accumulation, the
scales applied in the epilogue, bf16/fp16 out. At decode (M = the batch, 1..256) a linear reads all its weight
bytes to do little arithmetic, so half the bytes should be up to twice as fast as bf16; ``torch._scaled_mm``
runs one CUTLASS tile there (H200, issue 16: 1.4-2.7x *slower* than the bf16 GEMV). Here the tiles are small in M
(16-64 rows) and the K loop is split across programs (``split_k``) when the N tiles alone would leave SMs idle
(Llama-8B's o and down projections: N = 4096, 64 tiles of 64 columns on 132 SMs). A split-K launch writes
float32 partial sums (each already scaled: the scales factor out of the K sum) to a workspace that a second
small kernel adds up in a fixed order (deterministic; no atomics, no memset), then adds the bias and casts.

Triton's CPU interpreter emulates E4M3 wrongly (see ``fp8_quant.py``), so when interpreting the wrapper hands
the kernel float32 copies of the operands, which hold the E4M3 values exactly, and the dot runs in IEEE float32:
the tests check the kernel's tiling, masking, split-K and epilogue against the float32 reference of the same
quantized operands (``models.fp8.fp8_linear_reference``); the GPU sweep (``bench/gpu_fp8_sweep.py``) checks the
compiled FP8 dot. The interpreter also truncates float32 to bf16 (the GPU rounds to nearest even), so there the
kernel writes float32 and PyTorch rounds to the output dtype.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import DEFAULT_SMS, check, check_tensor, fail, interpret_mode, num_sms

FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One tiling of the kernel. ``split_k`` is the most K splits a launch uses (fewer when K is short);
    ``imprecise_acc``: 0 keeps Triton's default for FP8 dots (on sm_90 the tensor core's own, reduced-precision
    accumulation across the whole K loop), > 0 promotes to a float32 accumulator every that many K (CUTLASS's
    and DeepSeek's remedy; costs a little time)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    imprecise_acc: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"Fp8GemmConfig: bad split_k/num_warps/num_stages in {self}")
        if self.imprecise_acc < 0 or (self.imprecise_acc and self.imprecise_acc > self.block_k):
            raise ValueError(f"imprecise_acc: must be 0 or in [1, block_k], got {self.imprecise_acc}")

    def label(self) -> str:
        acc = f",acc{self.imprecise_acc}" if self.imprecise_acc else ""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}p{self.num_stages}{acc}")


def parse_config(text: str) -> Fp8GemmConfig:
    """``"BM,BN,BK,SPLIT,WARPS,STAGES[,IMPRECISE_ACC]"`` -> a config (an env var's form)."""
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) not in (6, 7):
        raise ValueError(f"fp8 gemm config: expected 'BM,BN,BK,SPLIT,WARPS,STAGES[,IMPRECISE_ACC]', got {text!r}")
    return Fp8GemmConfig(*vals)


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_SMS) -> Fp8GemmConfig:
    """The tiling for an ``[m, k] x [n, k]^T`` product: M tiles just big enough for the batch, and the K loop
    split until the launch has about a program per SM (each split keeping at least two K blocks)."""
    block_m = _pow2_at_least(m, 16, 64 if m <= 64 else 128)
    block_n = 64 if block_m <= 64 else 128
    block_k = 256 if block_m <= 32 else 128
    warps = 8 if block_m >= 128 else 4
    stages = 4 if block_m <= 64 else 3
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < num_sms and k_blocks // (split * 2) >= 2:
        split *= 2
    return Fp8GemmConfig(block_m, block_n, block_k, split, warps, stages)


# M is not specialized (one compiled variant for every batch size: M == 1 would be its own); k_per_split is (a
# multiple of BLOCK_K, so Triton knows every split starts 16-byte aligned and loads wide).
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_am, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + k_per_split, K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + (k_start + rk)[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + rk) < k_end
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        elif IMPRECISE_ACC > 0:
            acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    s_a = tl.load(a_scale_ptr + rm, mask=m_mask, other=0.0)
    s_w = tl.load(w_scale_ptr + rn, mask=n_mask, other=0.0)
    acc = acc * s_a[:, None] * s_w[None, :]
    out_ptrs = out_ptr + pid_k.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=mask)   # float32 partial sums, reduced by _split_k_reduce_kernel
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "splits"])
def _split_k_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, splits, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_scale(name: str, s: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    check_tensor(name, s, dtype=torch.float32, device=device, last_contiguous=False)
    if s.numel() != rows or not (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        fail(name, f"expected {rows} float32 scales as [{rows}, 1] or [{rows}], got shape {tuple(s.shape)}")
    s = s.reshape(rows)
    return s if s.stride(0) == 1 else s.contiguous()


def fp8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """``a_q [M, K]`` E4M3 with ``a_scale`` float32 ``[M, 1]``, ``w_q [N, K]`` E4M3 (a linear layer's weight,
    row-major) with ``w_scale`` float32 ``[N, 1]``, optional ``bias [N]`` -> ``[M, N]`` in ``out_dtype``."""
    check_tensor("a_q", a_q, ndim=2, dtype=FP8_DTYPE)
    device = a_q.device
    check_tensor("w_q", w_q, ndim=2, dtype=FP8_DTYPE, device=device)
    m, k = a_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        fail("w_q", f"shape {tuple(w_q.shape)}: in-features {w_q.shape[1]} != a_q's K {k}")
    s_a = _check_scale("a_scale", a_scale, m, device)
    s_w = _check_scale("w_scale", w_scale, n, device)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=device)
        check(bias.shape[0] == n, "bias", f"size {bias.shape[0]} != out-features {n}")
        check(bias.is_floating_point(), "bias", f"dtype {bias.dtype} is not a float dtype")
    check(out_dtype in OUT_DTYPES, "out_dtype", f"{out_dtype} not in {OUT_DTYPES}")
    out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(m, n))
    cfg = config or default_config(m, n, k, num_sms(device))
    interpreting = interpret_mode()
    result = out
    if interpreting and out_dtype != torch.float32:   # round in PyTorch (see the module docstring)
        out = torch.empty((m, n), dtype=torch.float32, device=device)
    if interpreting:   # float32 copies hold the E4M3 values exactly (see the module docstring)
        a_op, w_op = a_q.float(), w_q.float()
    else:
        a_op, w_op = a_q, w_q
    k_blocks = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_blocks, cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=device) if splits > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    _fp8_gemm_kernel[grid](
        a_op, s_a, w_op, s_w, bias if bias is not None else s_w, part,
        m, n, k, k_per_split, a_op.stride(0), w_op.stride(0), part.stride(-2), part.stride(0) if splits > 1 else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, SPLIT=splits > 1, HAS_BIAS=bias is not None,
        DOT_F32=interpreting, IMPRECISE_ACC=cfg.imprecise_acc,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        block = 1024
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            part, bias if bias is not None else s_w, out, m, n, splits, part.stride(0), part.stride(1),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return result.copy_(out) if result is not out else out
