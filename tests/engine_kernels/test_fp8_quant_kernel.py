"""The fused per-token FP8 quantization kernel against the PyTorch reference (models/fp8.quantize_per_row).

Scales and values must be bit-identical (same float32 arithmetic, round-to-nearest cast). Under Triton's CPU
interpreter the kernel leaves the final E4M3 cast to PyTorch (the interpreter's emulation of it is wrong), so
here the kernel's own arithmetic is checked; the GPU profile (bench/gpu_profile_issue16.py) checks the
compiled kernel's cast against the reference too.
"""

from __future__ import annotations

import pytest
import torch

import kvfleet.engine.kernels.fp8_quant as fq
from kvfleet.engine.models.fp8 import quantize_per_row


def _assert_matches_reference(x: torch.Tensor) -> None:
    q, scale = fq.per_token_quant_fp8(x)
    q_ref, scale_ref = quantize_per_row(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(1, 64), (7, 200), (3, 1000)])
def test_single_pass_matches_reference(dtype: torch.dtype, rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    x[0, cols // 2] = 60.0   # an outlier sets its row's scale
    _assert_matches_reference(x)


def test_rows_wider_than_one_block_take_two_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fq, "_SINGLE_PASS_MAX", 128)
    monkeypatch.setattr(fq, "_LOOP_BLOCK", 64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    x[2, 299] = -90.0   # the largest magnitude in the last, partial block
    _assert_matches_reference(x)


def test_zero_rows_and_empty_input() -> None:
    x = torch.zeros(2, 64)
    q, scale = fq.per_token_quant_fp8(x)
    assert torch.equal(scale, torch.full((2, 1), fq.MIN_SCALE)) and not q.float().any()
    q, scale = fq.per_token_quant_fp8(torch.zeros(0, 64))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="x"):
        fq.per_token_quant_fp8(torch.randn(4, 8, 2))
    with pytest.raises(ValueError, match="stride"):
        fq.per_token_quant_fp8(torch.randn(8, 4).t())
