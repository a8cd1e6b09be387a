"""The batched sampler on hand-made logits: each knob, per row, in one pass."""

from __future__ import annotations

from typing import Optional

import torch

from kvfleet.engine.kernels.token_bitmask import unpack_bitmask
from kvfleet.engine.sampler import AllowedTokens, LogitBias, Sampler, SamplingBatch

V = 8


def batch(rows: int, temperature: list[float], top_k: Optional[list[int]] = None,
          top_p: Optional[list[float]] = None, min_p: Optional[list[float]] = None,
          gens: Optional[dict[int, torch.Generator]] = None, logprobs: int = -1, **pen) -> SamplingBatch:
    def t(x, dtype=torch.float32):
        return None if x is None else torch.tensor(x, dtype=dtype)

    return SamplingBatch(
        temperature=t(temperature), top_k=t(top_k, torch.long), top_p=t(top_p), min_p=t(min_p),
        presence_penalty=t(pen.get("presence")), frequency_penalty=t(pen.get("frequency")),
        repetition_penalty=t(pen.get("repetition")), prompt_tokens=pen.get("prompt_tokens"),
        output_tokens=pen.get("output_tokens"), min_tokens_mask=pen.get("min_mask"), logit_bias=pen.get("bias"),
        allowed=pen.get("allowed"), generators=gens or {}, max_num_logprobs=logprobs,
        all_greedy=all(x == 0 for x in temperature))


def logits_rows(rows: int) -> torch.Tensor:
    base = torch.tensor([0.0, 3.0, 2.5, 2.0, 1.0, 0.5, -1.0, -2.0])
    return base.repeat(rows, 1)


def test_greedy_and_logprobs() -> None:
    out = Sampler()(logits_rows(2), batch(2, [0.0, 0.0], logprobs=3))
    assert out.sampled.tolist() == [1, 1]
    ref = logits_rows(1).log_softmax(-1)[0]
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs.logprob, ref[1].repeat(2))
    assert out.logprobs.rank.tolist() == [1, 1]
    assert out.logprobs.top_ids[0].tolist() == [1, 2, 3]
    assert torch.allclose(out.logprobs.top_logprobs[0], ref[1:4])
    assert Sampler()(logits_rows(2), batch(2, [0.0, 0.0])).logprobs is None   # none asked: none computed


def test_top_k_top_p_min_p_restrict_the_support_per_row() -> None:
    rows = 4
    seen: list[set[int]] = [set() for _ in range(rows)]
    probs = logits_rows(1).softmax(-1)[0]
    # top_p=0.5: the smallest set of top tokens reaching 50% mass.
    cum = probs.sort(descending=True).values.cumsum(0)
    n_top_p = int((cum < 0.5).sum()) + 1
    for _ in range(300):
        out = Sampler()(logits_rows(rows), batch(rows, [1.0] * rows, top_k=[2, V, V, V], top_p=[1.0, 0.5, 1.0, 1.0],
                                                  min_p=[0.0, 0.0, 0.5, 0.0]))
        for r, tok in enumerate(out.sampled.tolist()):
            seen[r].add(tok)
    assert seen[0] == {1, 2}
    assert seen[1] == set(probs.argsort(descending=True)[:n_top_p].tolist())
    assert seen[2] == {i for i in range(V) if probs[i] >= 0.5 * probs.max()}
    assert len(seen[3]) > 4                 # unrestricted row samples widely


def test_mixed_greedy_and_random_rows_in_one_batch() -> None:
    out = Sampler()(logits_rows(3), batch(3, [0.0, 1.0, 0.0], top_k=[V, 1, V]))
    assert out.sampled.tolist() == [1, 1, 1]   # top_k=1 is greedy too


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    def run(rows: int, row: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        toks = []
        for _ in range(20):
            out = Sampler()(logits_rows(rows), batch(rows, [1.0] * rows, gens={row: gen}))
            toks.append(out.sampled[row].item())
        return toks

    alone = run(1, 0)
    assert run(5, 3) == alone and len(set(alone)) > 1


def test_penalties() -> None:
    out_tokens = torch.tensor([[1, 1, V], [V, V, V]])
    # frequency 2.0 on token 1 seen twice: 3.0 - 4.0 = -1.0, so token 2 wins
    out = Sampler()(logits_rows(2), batch(2, [0.0, 0.0], frequency=[2.0, 0.0], output_tokens=out_tokens))
    assert out.sampled.tolist() == [2, 1]
    out = Sampler()(logits_rows(2), batch(2, [0.0, 0.0], presence=[1.0, 0.0], output_tokens=out_tokens))
    assert out.sampled.tolist() == [2, 1]   # 3.0 - 1.0 < 2.5
    prompt = torch.tensor([[1, 2], [V, V]])
    out = Sampler()(logits_rows(2), batch(2, [0.0, 0.0], repetition=[2.0, 1.0], prompt_tokens=prompt,
                                          output_tokens=torch.full((2, 1), V)))
    assert out.sampled.tolist() == [3, 1]   # 1 -> 1.5, 2 -> 1.25, 3 stays 2.0


def test_penalties_touch_only_listed_columns_and_equal_the_dense_definition() -> None:
    """Random batches of a larger vocabulary: ids repeated within and across the prompt and output lists, padding,
    rows with no output yet, rows without any id, neutral rows beside penalized ones, -inf logits (a min_tokens
    ban), each penalty alone and all three; the caller's logits are left as they were."""
    from kvfleet.engine.sampler import apply_penalties, apply_penalties_ref

    vocab, rows = 50, 7
    gen = torch.Generator().manual_seed(16)
    for case in range(40):
        high = 12 if case % 2 else vocab   # a few ids: many repeats

        def ids(width: int, lengths: list[int], high: int = high) -> torch.Tensor:
            t = torch.full((rows, width), vocab)
            for r, n in enumerate(lengths):
                t[r, :n] = torch.randint(0, high, (n,), generator=gen)
            return t

        plen = [int(x) for x in torch.randint(1, 9, (rows,), generator=gen)]
        olen = [int(x) for x in torch.randint(0, 6, (rows,), generator=gen)]
        olen[0] = 0   # no output yet
        with_prompt = case % 3 != 2
        if not with_prompt:
            olen[1] = 0   # no id at all in this row
        prompt = ids(max(plen), plen) if with_prompt else None
        output = ids(max(olen) + case % 2, olen)   # at times a spare padding column (a token in flight's)
        logits = torch.randn(rows, vocab, generator=gen) * 3
        logits[2, :5] = float("-inf")
        which = case % 4   # repetition, frequency, presence, all three

        def knob(active: bool, lo: float, hi: float) -> Optional[torch.Tensor]:
            if not active:
                return None
            v = torch.empty(rows).uniform_(lo, hi, generator=gen)
            v[3] = 1.0 if lo > 0 else 0.0   # a neutral row in the batch
            return v

        b = batch(rows, [0.0] * rows, prompt_tokens=prompt if which in (0, 3) else None, output_tokens=output)
        b.repetition_penalty = knob(which in (0, 3), 0.5, 2.0)
        b.frequency_penalty = knob(which in (1, 3), -2.0, 2.0)
        b.presence_penalty = knob(which in (2, 3), -2.0, 2.0)
        if b.repetition_penalty is None:
            b.prompt_tokens = None
        before = logits.clone()
        got = apply_penalties(logits, b)
        assert torch.equal(got, apply_penalties_ref(logits, b)), case
        assert torch.equal(logits, before)


def test_min_tokens_mask_bans_stop_tokens() -> None:
    mask = torch.zeros(1, V, dtype=torch.bool)
    mask[0, 1] = True
    out = Sampler()(logits_rows(1), batch(1, [0.0], min_mask=mask))
    assert out.sampled.tolist() == [2]


def test_logit_bias_moves_its_rows_tokens_only_and_not_the_raw_logprobs() -> None:
    """Row 0: +5 on token 6 (-1 -> 4, over the argmax 3) makes greedy pick it; row 1: -100 on the argmax
    (token 1) hands it to token 2; row 2 has no bias; row 3 samples with every token but 5 at -100, so it only
    ever draws 5. Raw logprobs are read before the bias, as vLLM's."""
    bias = LogitBias(rows=torch.tensor([0, 1, *[3] * (V - 1)]), token_ids=torch.tensor([6, 1, *[t for t in range(V)
                                                                                              if t != 5]]),
                     values=torch.tensor([5.0, -100.0, *[-100.0] * (V - 1)]))
    ref = logits_rows(1).log_softmax(-1)[0]
    for _ in range(50):
        out = Sampler()(logits_rows(4), batch(4, [0.0, 0.0, 0.0, 1.0], logprobs=0, bias=bias))
        assert out.sampled.tolist() == [6, 2, 1, 5]
        assert out.logprobs is not None and torch.allclose(out.logprobs.logprob, ref[[6, 2, 1, 5]])


def packed(allowed: list[list[int]], words: int = 1) -> torch.Tensor:
    """int32 bitmask rows (llguidance's layout): bit t % 32 of word t // 32 set = token t allowed."""
    out = torch.zeros(len(allowed), words, dtype=torch.int64)
    for r, toks in enumerate(allowed):
        for t in toks:
            out[r, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)   # bit 31 is the sign bit


def test_bitmask_unpacks_in_llguidance_layout() -> None:
    mask = packed([[0, 5, 31, 33], [63]], words=2)
    got = unpack_bitmask(mask, 40)
    assert got.shape == (2, 40)
    assert torch.nonzero(got[0]).flatten().tolist() == [0, 5, 31, 33]
    assert not got[1].any()   # token 63 is past the 40-token vocabulary: ignored


def test_structured_rows_sample_only_allowed_tokens_and_their_logprobs_renormalize() -> None:
    """Row 1 may take tokens 4 and 6 only (greedy: 4, though 1 is the most likely overall); row 0 is free; a
    random row draws only allowed tokens too; logprobs are over what may be sampled, as vLLM's."""
    allowed = AllowedTokens(torch.tensor([1, 2]), packed([[4, 6], [7]]))
    out = Sampler()(logits_rows(3), batch(3, [0.0, 0.0, 1.0], logprobs=2, allowed=allowed))
    assert out.sampled.tolist() == [1, 4, 7]
    assert out.logprobs is not None
    row = torch.tensor([1.0, -1.0]).log_softmax(-1)
    assert torch.allclose(out.logprobs.logprob[1], row[0]) and out.logprobs.top_ids[1].tolist() == [4, 6]
    assert out.logprobs.logprob[2].item() == 0.0   # the only token allowed
    for seed in range(20):   # a random draw never leaves the allowed set
        gen = torch.Generator().manual_seed(seed)
        one = AllowedTokens(torch.tensor([0]), packed([[2, 3, 5]]))
        assert Sampler()(logits_rows(1), batch(1, [1.0], gens={0: gen}, allowed=one)).sampled.item() in (2, 3, 5)


def test_structured_rows_leave_the_callers_float32_logits_as_they_were() -> None:
    """The mask is written into the sampler's own copy: the runner's logits (prompt logprobs read other rows
    of the same tensor) are not touched."""
    logits = logits_rows(2)
    before = logits.clone()
    Sampler()(logits, batch(2, [0.0, 0.0], allowed=AllowedTokens(torch.tensor([0]), packed([[3]]))))
    assert torch.equal(logits, before)


def test_a_plain_greedy_batch_takes_the_argmax_of_the_model_dtype() -> None:
    # logits in bfloat16 (the model's dtype, as compute_logits returns them), ties and large vocab rows included:
    # the argmax without a float32 copy is the float path's, token for token
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 4096, generator=gen) * 4).to(torch.bfloat16)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1   # a tie: the first index wins on both paths
    plain = Sampler()(logits, batch(64, [0.0] * 64))
    floated = Sampler()(logits, batch(64, [0.0] * 64, logprobs=0))   # logprobs asked: the float32 path
    assert plain.logprobs is None and floated.logprobs is not None
    assert torch.equal(plain.sampled, floated.sampled)
    assert torch.equal(plain.sampled, logits.float().argmax(-1)) and int(plain.sampled[3]) == 10


def test_every_knob_beyond_the_argmax_takes_the_float_path() -> None:
    from kvfleet.engine.sampler import needs_float_logits

    assert not needs_float_logits(batch(2, [0.0, 0.0]))
    cases = [batch(2, [0.0, 1.0]), batch(2, [0.0, 0.0], logprobs=0), batch(2, [0.0, 0.0], repetition=[1.1, 1.0]),
             batch(2, [0.0, 0.0], frequency=[0.5, 0.0]), batch(2, [0.0, 0.0], presence=[0.5, 0.0]),
             batch(2, [0.0, 0.0], min_mask=torch.zeros(2, V, dtype=torch.bool)),
             batch(2, [0.0, 0.0], bias=LogitBias(torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))),
             batch(2, [0.0, 0.0], allowed=AllowedTokens(torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32)))]
    assert all(needs_float_logits(b) for b in cases)
    # and a penalized greedy row in bfloat16 logits is penalized as in float32
    lg = logits_rows(1).to(torch.bfloat16)
    out = Sampler()(lg, batch(1, [0.0], repetition=[100.0], prompt_tokens=torch.tensor([[1]])))
    assert out.sampled.tolist() == [2]
