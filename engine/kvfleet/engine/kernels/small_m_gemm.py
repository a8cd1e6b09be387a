"""bf16/fp16 linear layer for a few rows (M = 1..16 tokens): ``out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])``.

At batch 1 a decoder's linear layers and its LM head are a read of their weights: the bytes matter, the
arithmetic does not. cuBLAS runs them as a split-K GEMV and a separate ``splitKreduce`` launch at ~3.5 TB/s on an
H200 (issue 16). Here each program owns ``BLOCK_N`` output columns (weight rows, contiguous in K) and walks K in
``BLOCK_K`` steps, loading ``[BLOCK_N, BLOCK_K]`` weight tiles as 16-byte vectors along K (``cp.async`` copies
``num_stages - 1`` steps ahead; ``num_stages=1``: plain loads); x ``[M, K]`` is tiny and stays in cache. The
accumulator is ``[BLOCK_N, M]`` (out transposed). Two ways to multiply, a config option:

* elementwise (M <= 2 by default): each x row is loaded as a ``[BLOCK_N, BLOCK_K]`` broadcast of itself, so it
  has the weight tile's layout: a float32 multiply and a sum over K inside each warp, no layout conversion in the
  loop (Triton gives a plain ``[1, BLOCK_K]`` row, or a 3-D ``[M, BLOCK_N, BLOCK_K]`` product, layouts that
  shuffle through shared memory or reduce across warps every step). No padding of M. By default each x row is
  loaded as a ``[BLOCK_K]`` vector and broadcast in registers instead (``x_vector``): the tile, pipelined, went
  through shared memory and read as many bytes from L2 as the weights; on an H200 the vector load runs at
  3.3-4.3 TB/s where the tile ran at 1.6-2.6 (M = 1, Llama-3.1-8B's layers).
* ``tl.dot`` (M > 2): ``w_tile @ x_tile^T`` with x padded to 16 rows, on tensor cores (wgmma from 64 columns),
  where the FMAs, the redundant x rows and the ``BLOCK_N x 16`` tile would otherwise grow with M.

There should be about two programs per SM: ``BLOCK_N`` shrinks until ``N / BLOCK_N`` reaches that, and when N is
too small even at the smallest tile (tensor-parallel shards, o/down with the dot) the K loop is split across
programs. A split launch writes float32 partial sums to a workspace that a second small kernel adds up in a fixed
order (deterministic: no atomics, no memset), then adds the bias and casts. Capturable in a CUDA graph: no host
syncs, the workspace from the torch allocator.

Triton's CPU interpreter truncates float32 to bf16 (the GPU rounds to nearest even) and cannot run a bf16
``tl.dot``: there the kernel writes float32 (PyTorch rounds to the output dtype) and upcasts the dot's operands.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ._common import DEFAULT_SMS, check, check_tensor, dot_precision, interpret_mode, next_pow2, num_sms

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_M = 16
ELEMENTWISE_MAX_M = 2       # the default mode: elementwise up to here, tl.dot above
_PROGRAMS_PER_SM = 2        # what the heuristic aims the launch at
_TILE_ELEMS = {False: 4096, True: 8192}   # weight elements per K step of a program (elementwise, dot): 8/16 KB
_MIN_BLOCK_N = {False: 8, True: 16}       # tl.dot needs 16 columns
_MAX_BLOCK_N = {False: 32, True: 64}
_REDUCE_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class SmallMGemmConfig:
    """One tiling. ``split_k``: the most K splits a launch uses (fewer when K is short); ``use_dot``: tensor
    cores on x padded to 16 rows instead of elementwise FMAs; ``x_vector`` (elementwise only): each x row loaded
    as a ``[BLOCK_K]`` vector and broadcast in registers, where the default loads it as a ``[BLOCK_N, BLOCK_K]``
    tile (pipelined, that tile goes through shared memory: as many bytes from L2 as the weight tile's; the vector
    is ``BLOCK_N`` times fewer, sm_90 TTGIR shows no layout conversion in the loop either way)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    x_vector: bool = False

    def __post_init__(self) -> None:
        lo = _MIN_BLOCK_N[self.use_dot]
        if self.x_vector and self.use_dot:
            raise ValueError("x_vector: only for the elementwise mode (the dot loads x as a tile)")
        if self.block_n < lo or self.block_n > 256 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: must be a power of two in [{lo}, 256], got {self.block_n}")
        if self.block_k < 16 or self.block_k > 1024 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k: must be a power of two in [16, 1024], got {self.block_k}")
        if self.split_k < 1:
            raise ValueError(f"split_k: must be >= 1, got {self.split_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps: must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages: must be >= 1, got {self.num_stages}")

    def label(self) -> str:
        return (f"{'dot' if self.use_dot else 'ewv' if self.x_vector else 'ew'}n{self.block_n}k{self.block_k}"
                f"s{self.split_k}w{self.num_warps}p{self.num_stages}")


def block_m_for(m: int, use_dot: bool) -> int:
    """Rows of the x tile: 16 for a dot, else the rows rounded up to a power of two."""
    return 16 if use_dot else next_pow2(m)


@functools.cache
def default_small_m_config(m: int, n: int, k: int, num_sms: int = DEFAULT_SMS) -> SmallMGemmConfig:
    """The tiling for ``[m, k] x [n, k]^T``: the widest column block that still gives about two programs per SM,
    a K step of 8 (elementwise) or 16 KB (dot) of weights, and K split in two, four, ... only when even the
    narrowest block leaves fewer programs (each split keeping at least two K steps)."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"m: expected 1..{MAX_M} rows, got {m}")
    use_dot = m > ELEMENTWISE_MAX_M
    target = _PROGRAMS_PER_SM * num_sms
    block_n = _MAX_BLOCK_N[use_dot]
    while block_n > _MIN_BLOCK_N[use_dot] and triton.cdiv(n, block_n) < target:
        block_n //= 2
    block_k = min(max(_TILE_ELEMS[use_dot] // block_n, 64), 512 if not use_dot else 256)
    block_k = max(16, min(block_k, next_pow2(k)))
    tiles, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while tiles * split < target and k_blocks // (split * 2) >= 2:
        split *= 2
    # elementwise: x rows as vectors (x_vector) and 4 stages, the H200 sweep's best or within 2 % of it at M = 1 on
    # every Llama-3.1-8B shape (bench/results/issue16/lease12/: 1.03-1.11x cuBLAS; the broadcast tile: 0.5-0.8x)
    return SmallMGemmConfig(block_n, block_k, split, num_warps=4, num_stages=4, use_dot=use_dot,
                            x_vector=not use_dot)


# M is not specialized (M == 1 would compile its own variant); k_per_split is a multiple of BLOCK_K, so Triton
# knows every split starts 16-byte aligned and loads wide.
@triton.jit(do_not_specialize=["M"])
def _small_m_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, X_VECTOR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_end = tl.minimum(k_start + k_per_split, K)
    # the dot loads x as a [BLOCK_M, BLOCK_K] tile; elementwise, one row at a time broadcast to the weight tile's
    # shape, which gives it the weight tile's layout (see the module docstring)
    if USE_DOT:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_start + rk)[None, :]
    elif X_VECTOR:
        x_ptrs = x_ptr + k_start + rk
    else:
        x_ptrs = tl.broadcast_to(x_ptr + (k_start + rk)[None, :], (BLOCK_N, BLOCK_K))
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + (k_start + rk)[None, :]
    # [BLOCK_N, BLOCK_M]: the elementwise mode's sums over K land in this orientation without a layout change
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # tl.range's num_stages: the pipeliner prefetches the tiles (cp.async) even without a dot in the loop
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            k_mask = rk < BLOCK_K
            if EVEN_N:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_mask = (k + rk) < k_end
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        if USE_DOT:
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_last")
            if UPCAST:
                acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
        else:
            # one x row at a time against the weight tile, in the same layout: each sum over K stays in a warp
            wf = w.to(tl.float32)
            for i in tl.static_range(BLOCK_M):
                if X_VECTOR:
                    xv = tl.load(x_ptrs + i * stride_xm, mask=(i < M) & k_mask, other=0.0,
                                 eviction_policy="evict_last")
                    xi = xv[None, :]
                else:
                    xi = tl.load(x_ptrs + i * stride_xm, mask=(i < M) & k_mask[None, :], other=0.0,
                                 eviction_policy="evict_last")
                part = tl.sum(wf * xi.to(tl.float32), axis=1)
                acc = tl.where(rm[None, :] == i, acc + part[:, None], acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + pid_k.to(tl.int64) * stride_os + rm[None, :] * stride_om + rn[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=mask)   # float32 partial sums, reduced by _split_k_sum_kernel
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "splits"])
def _split_k_sum_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, splits, stride_ps, stride_pm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):   # a fixed order: the same sum every run
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def small_m_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 config: SmallMGemmConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` (M <= 16, K contiguous), ``w [N, K]`` contiguous (an nn.Linear weight) of x's dtype, optional
    ``bias [N]`` -> ``[M, N]`` in x's dtype, accumulated in float32."""
    check_tensor("x", x, ndim=2, dtype=DTYPES)
    device = x.device
    check_tensor("w", w, ndim=2, dtype=x.dtype, device=device)
    m, k = x.shape
    n = w.shape[0]
    check(m <= MAX_M, "x", f"{m} rows: the kernel takes at most {MAX_M}")
    check(w.shape[1] == k, "w", f"shape {tuple(w.shape)}: in-features {w.shape[1]} != x's K {k}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=device)
        check(bias.shape[0] == n, "bias", f"size {bias.shape[0]} != out-features {n}")
        check(bias.is_floating_point(), "bias", f"dtype {bias.dtype} is not a float dtype")
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(x.dtype).expand(m, n))
    cfg = config or default_small_m_config(m, n, k, num_sms(device))
    interpreting = interpret_mode()
    result = out
    if interpreting and x.dtype != torch.float32:   # round in PyTorch (see the module docstring)
        out = torch.empty((m, n), dtype=torch.float32, device=device)
    k_blocks = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(k_blocks, cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=device) if splits > 1 else out
    _small_m_gemm_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, w, bias if bias is not None else w, part,
        m, n, k, k_per_split, x.stride(0), w.stride(0), part.stride(-2), part.stride(0) if splits > 1 else 0,
        BLOCK_M=block_m_for(m, cfg.use_dot), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, SPLIT=splits > 1, HAS_BIAS=bias is not None,
        USE_DOT=cfg.use_dot, UPCAST=interpreting, PREC=dot_precision(x.dtype), X_VECTOR=cfg.x_vector,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _split_k_sum_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](
            part, bias if bias is not None else part, out, m, n, splits, part.stride(0), part.stride(1),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        )
    return result.copy_(out) if result is not out else out


__all__ = ["DTYPES", "MAX_M", "SmallMGemmConfig", "block_m_for", "default_small_m_config", "small_m_gemm"]
