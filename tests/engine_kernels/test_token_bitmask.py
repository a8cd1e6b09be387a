"""The structured-outputs mask kernel against its plain-PyTorch reference (Triton's interpreter on CPU)."""

import pytest
import torch

from kvfleet.engine.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref_, unpack_bitmask


@pytest.mark.parametrize("vocab,rows", [(40, [1]), (1024, [0, 2]), (2500, [3, 0, 1])])
def test_mask_kernel_matches_reference(vocab: int, rows: list[int]) -> None:
    """Random words (the sign bit included), a vocabulary that ends inside a word and inside a program's
    block, constrained rows in any order, and logits whose rows are wider than the vocabulary (a strided
    view): the kernel writes -inf exactly where the reference does and leaves every other logit alone."""
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 + 1   # one word past the vocabulary, as llguidance may pack
    bitmask = torch.randint(-2**31, 2**31, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    wide = torch.randn(4, vocab + 7, generator=gen)
    want = wide[:, :vocab].clone()
    apply_token_bitmask_ref_(want, bitmask, torch.tensor(rows))
    got = wide[:, :vocab]
    apply_token_bitmask_(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    banned = ~unpack_bitmask(bitmask, vocab)
    assert torch.isneginf(got[rows]).eq(banned).all()           # exactly the banned tokens, per row
    free = [r for r in range(4) if r not in rows]
    assert not torch.isneginf(got[free]).any()                  # unconstrained rows untouched
    assert not torch.isneginf(wide[:, vocab:]).any()            # nothing written past the vocabulary


def test_mask_kernel_rejects_a_bitmask_too_short_for_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask_(torch.zeros(1, 70), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]))
