"""Structured outputs: set the logits of the tokens a row's constraint does not allow to -inf, in place.

The constraint's allowed tokens come as llguidance packs them: int32 words, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. One pass reads each word where its logits are: no
unpacked ``[N, V]`` mask (an int32 temporary of 4 bytes a token for the plain-PyTorch way) and no copy
of the constrained rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_tensor, fail

_BLOCK = 1024   # tokens a program covers: 32 words


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, stride_logits, stride_mask, vocab_size, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + i * stride_mask + tokens // 32, mask=in_vocab, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + tokens, float("-inf"), mask=in_vocab & banned)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Row ``rows[i]`` of ``logits`` [B, V] keeps only the tokens ``bitmask[i]`` allows (in place)."""
    check_tensor("logits", logits, ndim=2, dtype=(torch.float32,))
    check_tensor("bitmask", bitmask, ndim=2, dtype=(torch.int32,), device=logits.device)
    check_tensor("rows", rows, ndim=1, dtype=(torch.int64, torch.int32), device=logits.device)
    vocab_size = logits.shape[1]
    if not (rows.shape[0] == bitmask.shape[0]):
        fail("rows", f"length {rows.shape[0]} != bitmask rows {bitmask.shape[0]}")
    if not (bitmask.shape[1] * 32 >= vocab_size):
        fail("bitmask", f"{bitmask.shape[1]} words cover fewer than the {vocab_size} tokens")
    if rows.shape[0] == 0:
        return
    grid = (rows.shape[0], triton.cdiv(vocab_size, _BLOCK))
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows, logits.stride(0), bitmask.stride(0), vocab_size, BLOCK=_BLOCK,
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size] from packed int32 words (little-endian bits; words past the vocabulary ignored)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask_ref_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain-PyTorch reference: same effect as :func:`apply_token_bitmask_`."""
    banned = ~unpack_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
