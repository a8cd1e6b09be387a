"""Batched sampling on the device: one pass for the whole batch.

Order (as vLLM): structured outputs mask the tokens their constraint does not allow (so the
logprobs, too, are of what may be sampled); raw log-probabilities for the logprobs outputs; min_tokens masks
the stop tokens; logit_bias adds to its tokens' logits; repetition, frequency and
presence penalties; greedy rows take the argmax; random rows divide by the temperature,
apply top-k, top-p and min-p and draw with the exponential race `argmax(p / q)`,
`q ~ Exp(1)`. A seeded row draws its
`q` from its own `torch.Generator`, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref_

_NEG_INF = float("-inf")


@dataclass
class LogitBias:
    """The batch's logit_bias entries, flat: logits[rows[i], token_ids[i]] += values[i]."""

    rows: torch.Tensor        # long [N]
    token_ids: torch.Tensor   # long [N]
    values: torch.Tensor      # float [N]


@dataclass
class AllowedTokens:
    """Structured outputs: for the batch's constrained rows, the tokens their constraint allows next."""

    rows: torch.Tensor      # long [N]
    bitmask: torch.Tensor   # int32 [N, ceil(V' / 32)], V' >= V: bit t % 32 of word t // 32 set = token t allowed


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, on the device."""

    temperature: torch.Tensor                 # float [B]; 0 = greedy
    top_k: Optional[torch.Tensor]             # long [B] (vocab size = off), None if no row uses it
    top_p: Optional[torch.Tensor]             # float [B], None if no row uses it
    min_p: Optional[torch.Tensor]             # float [B], None if no row uses it
    presence_penalty: Optional[torch.Tensor]  # float [B]
    frequency_penalty: Optional[torch.Tensor]  # float [B]
    repetition_penalty: Optional[torch.Tensor]  # float [B]
    prompt_tokens: Optional[torch.Tensor]     # long [B, Lp], padded with vocab_size
    output_tokens: Optional[torch.Tensor]     # long [B, Lo], padded with vocab_size
    min_tokens_mask: Optional[torch.Tensor]   # bool [B, V]: stop tokens banned (min_tokens not reached)
    logit_bias: Optional[LogitBias]           # None if no row has one
    allowed: Optional[AllowedTokens]          # None if no row is constrained
    generators: dict[int, torch.Generator]    # row -> its seeded generator
    max_num_logprobs: int                     # top-k width; -1 = no logprobs wanted
    all_greedy: bool


class TokenLogprobs(NamedTuple):
    """Per row: the log-probability of a chosen token, its rank and the row's top k."""

    logprob: torch.Tensor       # float [B]
    rank: torch.Tensor          # long [B], 1 = most likely
    top_ids: torch.Tensor       # long [B, K]
    top_logprobs: torch.Tensor  # float [B, K]


@dataclass
class SamplerOutput:
    sampled: torch.Tensor                     # long [B]
    logprobs: Optional[TokenLogprobs]         # of the sampled tokens (raw, before penalties); None if unasked


def _anchor(vocab: int, *token_lists: Optional[torch.Tensor]) -> torch.Tensor:
    """Per row, a column the penalties touch anyway, for the padding entries of its token lists to point at: the
    first id of the first list with one (a row's prompt is never empty), else 0 (a row with no ids at all)."""
    firsts = [t[:, 0] for t in token_lists if t is not None]
    anchor = torch.zeros_like(firsts[0])
    for first in reversed(firsts):   # the first list's id wins
        anchor = torch.where(first < vocab, first, anchor)
    return anchor


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties, touching only the columns of each row's prompt and output ids
    (gathered, penalized, scattered back) instead of [B, V] masks and counts: at ~1,000 rows of a 128k vocabulary
    those were ~8 GB of memory traffic a step and half-gigabyte temporaries (issue 16, lease 23: chat-mix with a
    repetition penalty ~4 % under the same run without). Every entry that points at a column writes the same value
    there, a function of its row and column only, so a token listed twice (or a padding entry sent to the row's
    anchor column) is penalized once: the result equals `apply_penalties_ref`'s, element for element (tests)."""
    vocab = logits.shape[-1]
    prompt, output = b.prompt_tokens, b.output_tokens
    lists = [t for t in (prompt, output) if t is not None]
    if not lists:
        return logits
    anchor = _anchor(vocab, prompt, output).unsqueeze(1)
    result = logits
    if b.repetition_penalty is not None:
        listed = torch.cat(lists, dim=1)
        real = listed < vocab
        cols = torch.where(real, listed, anchor)
        x = logits.gather(1, cols)
        pen = b.repetition_penalty.unsqueeze(1)
        # a padding entry sits on its row's anchor, an id of the row: seen, unless the row lists no id at all
        seen = real | real.any(dim=1, keepdim=True)
        x = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)
        result = logits.scatter(1, cols, x)   # out of place: the caller's logits stay as they were
    if output is not None and (b.frequency_penalty is not None or b.presence_penalty is not None):
        cols = torch.where(output < vocab, output, anchor)
        ordered = output.sort(dim=1).values   # padding (vocab) last; counts by binary search, no [B, V] counts
        counts = (torch.searchsorted(ordered, cols, right=True) - torch.searchsorted(ordered, cols)).float()
        x = result.gather(1, cols)
        if b.frequency_penalty is not None:
            x = x - b.frequency_penalty.unsqueeze(1) * counts
        if b.presence_penalty is not None:
            x = x - b.presence_penalty.unsqueeze(1) * (counts > 0).float()
        result = result.scatter_(1, cols, x) if result is not logits else logits.scatter(1, cols, x)
    return result


def apply_penalties_ref(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The penalties by their definition (as vLLM's): [B, V] counts of each row's output ids and a [B, V] mask of
    the ids it has seen (prompt and output). `apply_penalties` equals it element for element (tests;
    `bench/gpu_penalties.py` times both)."""
    vocab = logits.shape[-1]

    def counts(tokens: torch.Tensor) -> torch.Tensor:
        c = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
        c.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
        return c[:, :vocab]

    out_counts = counts(b.output_tokens) if b.output_tokens is not None else None
    if b.repetition_penalty is not None:
        seen = out_counts > 0 if out_counts is not None else torch.zeros_like(logits, dtype=torch.bool)
        if b.prompt_tokens is not None:
            seen = seen | (counts(b.prompt_tokens) > 0)
        pen = b.repetition_penalty.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
    if out_counts is not None:
        if b.frequency_penalty is not None:
            logits = logits - b.frequency_penalty.unsqueeze(1) * out_counts
        if b.presence_penalty is not None:
            logits = logits - b.presence_penalty.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.top_k is not None or b.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        vocab = logits.shape[-1]
        if b.top_k is not None:
            kth = sorted_logits.gather(1, (vocab - b.top_k).clamp(min=0).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        if b.top_p is not None:
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - b.top_p).unsqueeze(1)
            drop[:, -1] = False   # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if b.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * b.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return probs.div_(q).argmax(dim=-1)


def apply_allowed_(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Every token the constrained rows may not take at -inf, in place (one Triton pass on a GPU)."""
    if logits.is_cuda:
        apply_token_bitmask_(logits, allowed.bitmask, allowed.rows)
    else:
        apply_token_bitmask_ref_(logits, allowed.bitmask, allowed.rows)


def needs_float_logits(b: SamplingBatch) -> bool:
    """Whether a step's sampling reads more than the argmax: anything but a greedy batch without logprobs, masks,
    biases or penalties. The argmax of logits in the model dtype is that of their float32 copy (the cast is exact
    and keeps the order, ties included)."""
    return not (b.all_greedy and b.max_num_logprobs < 0 and b.allowed is None and b.min_tokens_mask is None
                and b.logit_bias is None and b.repetition_penalty is None and b.frequency_penalty is None
                and b.presence_penalty is None)


class Sampler:
    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        """Token ids for the rows of `logits` (any float dtype; the model's own, from `compute_logits`)."""
        if not needs_float_logits(b):
            return SamplerOutput(logits.argmax(dim=-1), None)
        # a float32 copy the sampler owns (structured outputs write into it; the caller's rows stay as they were)
        logits = logits.clone() if b.allowed is not None and logits.dtype == torch.float32 else logits.float()
        if b.allowed is not None:
            apply_allowed_(logits, b.allowed)
        raw_logprobs = logits.log_softmax(dim=-1) if b.max_num_logprobs >= 0 else None
        if b.min_tokens_mask is not None:
            logits = logits.masked_fill(b.min_tokens_mask, _NEG_INF)
        if b.logit_bias is not None:
            bias = b.logit_bias
            logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
        if b.repetition_penalty is not None or b.frequency_penalty is not None or b.presence_penalty is not None:
            logits = apply_penalties(logits, b)
        greedy = logits.argmax(dim=-1)
        if b.all_greedy:
            sampled = greedy
        else:
            temp = torch.where(b.temperature < 1e-5, torch.ones_like(b.temperature), b.temperature)
            scaled = apply_top_k_top_p_min_p(logits / temp.unsqueeze(1), b)
            rand = random_sample(scaled.softmax(dim=-1), b.generators)
            sampled = torch.where(b.temperature < 1e-5, greedy, rand)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, sampled, b.max_num_logprobs))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """Per row: the logprob of token_ids, their rank, the top-k ids and logprobs."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    rank = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    return TokenLogprobs(chosen, rank, top_ids, top_lp)
