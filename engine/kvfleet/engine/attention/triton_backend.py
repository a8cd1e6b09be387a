"""The Triton attention op: same signature as ``torch_paged_attention``.

Writes the step's K/V into the paged cache (rotating q and k on the way when given
`rotary`: one fused kernel unless KVFLEET_ROTARY_CACHE=0, which keeps the two of
before, for A/B runs), then runs the prefill kernel for the
sequences with more than one new token and the (split-K) decode kernel for the
single-token ones, each kernel skipping the other's sequences. Decode rows that
share leading KV blocks (`attention.shared_prefix`) first attend over that prefix
together (`kernels.shared_prefix`), then the decode kernel reads the rest of each
context and folds the prefix's partial in. A pure decode step (``max_query_len == 1``)
reads no host lists once its shared-prefix plan is in ``md.plans`` (a captured step
puts its static buffers there), so it can be captured in a CUDA graph. `kvfleet.engine.attention` registers it
(preferred on CUDA) when a backend is first chosen.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np
import torch

from kvfleet.engine.attention import shared_prefix as sp
from kvfleet.engine.attention.fresh_prompts import GLUON_MIN_QUERY_TOKENS, fresh_long_prompts, long_prefix_chunks
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.env_settings import EnvSettingError
from kvfleet.engine.head_norm import QKNorm
from kvfleet.engine.kernels.paged_decode import (
    SharedPrefixArgs,
    choose_decode_split,
    choose_mixed_decode_splits,
    mixed_split_batches,
    paged_decode_attention,
)
from kvfleet.engine.kernels.prefill_attention import (
    default_block_m,
    prefill_attention,
    prefill_work,
    prefill_work_pairs,
)
from kvfleet.engine.kernels.prefill_attention_gluon import (
    GLUON_SCHEDULES,
    engine_tiles,
    gluon_applies,
    paged_applies,
    prefill_attention_gluon,
    prefill_attention_gluon_paged,
)
from kvfleet.engine.kernels.prefill_attention_v2 import (
    SHORT_QUERY_MAX_TOKENS,
    default_tile_v2,
    prefill_attention_v2,
    tma_applies,
)
from kvfleet.engine.kernels.reshape_and_cache import reshape_and_cache
from kvfleet.engine.kernels.rms_norm import rms_norm
from kvfleet.engine.kernels.rotary import apply_rotary_cos_sin
from kvfleet.engine.kernels.rotary_cache import rotary_and_cache
from kvfleet.engine.kernels.shared_prefix import members_per_item, shared_prefix_attention
from kvfleet.engine.rope import Rotary

# read once: "0" rotates q/k with the rotary kernel, then writes the cache with reshape_and_cache
FUSED_ROTARY_CACHE = os.environ.get("KVFLEET_ROTARY_CACHE", "1") != "0"


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: keep the split count small


@functools.lru_cache(maxsize=4)
def prefill_tile(raw: str, name: str = "KVFLEET_PREFILL_TILE") -> tuple[int, int, int, int] | None:
    """KVFLEET_PREFILL_TILE="BLOCK_M,BLOCK_N,num_warps,num_stages" for query chunks over 16 tokens (the A/B
    of issue 16's long-prompt rows), for either kernel; unset: the kernel's defaults (v1: 64, 64, 4, 2, the v1
    sweep's best at 8 x 1024; v2: `default_tile_v2`)."""
    if not raw.strip():
        return None
    try:
        bm, bn, warps, stages = (int(x) for x in raw.split(","))
    except ValueError as e:
        raise ValueError(f"{name}: expected 'BLOCK_M,BLOCK_N,num_warps,num_stages', got {raw!r}") from e
    if not (bm in (16, 32, 64, 128, 256) and bn in (16, 32, 64, 128, 256) and warps in (1, 2, 4, 8, 16)
            and 1 <= stages <= 6):
        raise ValueError(f"{name}: unsupported tile {raw!r}")
    return bm, bn, warps, stages


PREFILL_KERNELS = ("v1", "v2", "v2-paged", "gluon", "gluon-chunks")
GLUON_CHOICES = ("gluon", "gluon-chunks")


def prefill_kernel_choice(raw: str) -> str:
    """KVFLEET_PREFILL_KERNEL: "gluon-chunks" (the default: "gluon", and the chunks over a cached prefix that
    `long_prefix_chunks` picks go to the Gluon kernel's paged form, on caches of blocks shorter than its key tile;
    on an H100 in issue 16's lease 18 it beat "gluon" on long prompts and the shared-prefix row in two runs each,
    +0.5 %, and "v2" by +1.7 % and +0.5-1.1 %), "gluon" (v2, but a step's fresh prompts of
    `GLUON_MIN_QUERY_TOKENS` and more go to the Gluon FlashAttention-3-style kernel where it applies: a Hopper
    GPU, 16-bit, head dim 64/128; eager steps only, captured ones keep v2), "v2" (`prefill_attention_v2` alone:
    split causal loop, heaviest-first work, GQA-ordered grid, the new tokens' K/V from the step's projections by
    TMA on Hopper; what every Gluon choice falls back to where it does not apply), "v2-paged" (v2 reading every key
    through the block table) or "v1" (the first kernel)."""
    choice = raw.strip() or "gluon-chunks"
    if choice not in PREFILL_KERNELS:
        raise EnvSettingError(f"KVFLEET_PREFILL_KERNEL: expected one of {', '.join(PREFILL_KERNELS)}, got {raw!r}")
    return choice


def prefill_cache_extra_stages(raw: str) -> int:
    """KVFLEET_PREFILL_CACHE_EXTRA_STAGES: how many pipeline stages deeper than the tile's ``num_stages`` v2's
    loop over cached keys runs (`prefill_attention_v2`'s ``cache_stages``; a chunk's cached prefix, a prefix-cache
    hit). 2, the default, gives that loop's K/V tiles the three buffers and two-tile lead the loops over new keys
    have (its tile address is a block-table load, which costs the pipeliner a stage): on an H200 +11 % on a 2k
    chunk over 6k cached keys and +22 % on 16 x 384 tokens over a shared 2k prefix, same shared memory and
    registers (issue 16, lease 12). 0 keeps every loop at the tile's depth."""
    try:
        extra = int(raw.strip() or "2")
    except ValueError as e:
        raise EnvSettingError(f"KVFLEET_PREFILL_CACHE_EXTRA_STAGES: expected an integer 0..4, got {raw!r}") from e
    if not 0 <= extra <= 4:
        raise EnvSettingError(f"KVFLEET_PREFILL_CACHE_EXTRA_STAGES: expected an integer 0..4, got {raw!r}")
    return extra


def gluon_schedule_choice(raw: str) -> str:
    """KVFLEET_GLUON_SCHEDULE: how the Gluon prefill kernels' warps share a query tile (`engine_tiles`):
    "two-warpgroups" (the default: a producer warp and the two warpgroups as two consumers of 64 query rows, each
    waiting and freeing on its own; on an H100 in issue 16's lease 19 +16 % over "fa3" on fresh prompts, +13 % on a
    chunk over a cached prefix, long prompts +1.5 % end to end), "pingpong" (the same consumers issuing their MMAs
    in turns: FlashAttention-3's ping-pong) or "fa3" (the eight warps in step; chunks with a producer warp)."""
    choice = raw.strip() or "two-warpgroups"
    if choice not in GLUON_SCHEDULES:
        raise EnvSettingError(f"KVFLEET_GLUON_SCHEDULE: expected one of {', '.join(GLUON_SCHEDULES)}, got {raw!r}")
    return choice


def gluon_min_query_tokens(raw: str) -> int:
    """KVFLEET_GLUON_MIN_QUERY_TOKENS: the shortest fresh prompt the Gluon kernel takes (`fresh_long_prompts`;
    default `GLUON_MIN_QUERY_TOKENS`, 2,048). With two consumer warpgroups it ran 8 x 1,024 tokens at 240 TFLOP/s
    against v2's 220 on an H100 (issue 16, lease 19), but attention is ~2 % of a 1k prompt's work: 1,024 is an
    A/B for the 1k-prompt rows, not expected to move them much."""
    try:
        tokens = int(raw) if raw.strip() else GLUON_MIN_QUERY_TOKENS
    except ValueError as e:
        raise EnvSettingError(f"KVFLEET_GLUON_MIN_QUERY_TOKENS: expected an integer >= 128, got {raw!r}") from e
    if tokens < 128:
        raise EnvSettingError(f"KVFLEET_GLUON_MIN_QUERY_TOKENS: expected an integer >= 128, got {raw!r}")
    return tokens


def gluon_page_loads_choice(raw: str) -> str:
    """KVFLEET_GLUON_PAGE_LOADS: how the paged Gluon kernel's producer warp reads a key tile's cache blocks:
    "per-copy" (the default: a block-table load before each of the tile's TMA copies, 16 for a 128-key tile's K and
    V in 16-token blocks) or "per-tile" (one load of the tile's blocks, issued before it waits for the slot, shared
    by the K and V copies). On an H100 (issue 16, lease 19, its kernel alone): +4 % on a 2k chunk over 6k cached
    keys, -4 % on 16 x 384 tokens over a 2k prefix; not yet measured end to end."""
    choice = raw.strip() or "per-copy"
    if choice not in ("per-copy", "per-tile"):
        raise EnvSettingError(f"KVFLEET_GLUON_PAGE_LOADS: expected per-copy or per-tile, got {raw!r}")
    return choice


# Read once: the choice is the process's, like the compiled kernels it selects.
PREFILL_KERNEL = prefill_kernel_choice(os.environ.get("KVFLEET_PREFILL_KERNEL", ""))
GLUON_MIN_QUERY = gluon_min_query_tokens(os.environ.get("KVFLEET_GLUON_MIN_QUERY_TOKENS", ""))
GLUON_TILE, GLUON_CHUNK_TILE = engine_tiles(
    gluon_schedule_choice(os.environ.get("KVFLEET_GLUON_SCHEDULE", "")),
    pages_at_once=gluon_page_loads_choice(os.environ.get("KVFLEET_GLUON_PAGE_LOADS", "")) == "per-tile")
PREFILL_CACHE_EXTRA_STAGES = prefill_cache_extra_stages(os.environ.get("KVFLEET_PREFILL_CACHE_EXTRA_STAGES", ""))


class PrefillPlan(NamedTuple):
    """How a step with prefill runs its attention: computed once per step (the first layer)."""

    mixed: bool                        # single-token (decode) rows too: the decode kernel runs after the prefill
    kernel: str                        # "v1", "v2" or "v2-paged": the Triton kernel of every prompt not in gluon_work
    tile: tuple[int, int, int, int]    # BLOCK_M, BLOCK_N, num_warps, num_stages
    work: torch.Tensor                 # the prefill kernel's work list
    gluon_work: torch.Tensor | None = None   # the Gluon kernel's work list (fresh long prompts), or None: not used
    gluon_chunk_work: torch.Tensor | None = None   # its paged form's (chunks over a cached prefix), or None
    decode_splits: int = 1             # the decode rows' key splits (`choose_mixed_decode_splits`; captured: 1)


def _prefill_tile(kernel: str, max_query_len: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The prefill kernel's tile for a step whose longest query is `max_query_len` tokens."""
    if kernel != "v1":
        tile = default_tile_v2(max_query_len, dtype)
    else:
        tile = (default_block_m(max_query_len, dtype), 64, 4, 2)
    custom = prefill_tile(os.environ.get("KVFLEET_PREFILL_TILE", ""))
    if custom is not None and max_query_len > 16:
        tile = custom
    short = prefill_tile(os.environ.get("KVFLEET_PREFILL_TILE_SHORT", ""), "KVFLEET_PREFILL_TILE_SHORT")
    if short is not None and 16 < max_query_len <= SHORT_QUERY_MAX_TOKENS:
        tile = short
    return tile


def _triton_kernel(choice: str) -> str:
    """The Triton prefill kernel behind a KVFLEET_PREFILL_KERNEL choice (the Gluon ones run v2 beside their kernel)."""
    return "v2" if choice in GLUON_CHOICES else choice


def _prefill_plan(md: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor) -> PrefillPlan:
    """The step's `PrefillPlan`, made from the first layer's tensors and kept in `md.plans` for the other layers."""
    plan = md.plans.get("triton_prefill")
    if isinstance(plan, PrefillPlan):
        return plan
    dtype, device = q.dtype, q.device
    gluon_ok = PREFILL_KERNEL in GLUON_CHOICES and k.dtype == kv_cache.dtype and gluon_applies(q, k, v)
    chunks_ok = gluon_ok and PREFILL_KERNEL == "gluon-chunks" and paged_applies(kv_cache, GLUON_CHUNK_TILE.block_n)
    qsl = md.query_start_loc_cpu
    decodes = np.diff(np.asarray(qsl)) == 1
    mixed = bool(decodes.any())
    decode_splits = 1
    if mixed:
        decode_splits = choose_mixed_decode_splits(int(decodes.sum()), kv_cache.shape[3],
                                                   int(np.asarray(md.seq_lens_cpu)[decodes].max()), _num_sms(device),
                                                   batch=len(decodes))
    kernel = _triton_kernel(PREFILL_KERNEL)
    tile = _prefill_tile(kernel, md.max_query_len, dtype)
    seq_lens = md.seq_lens_cpu if kernel != "v1" else None   # v2 takes its work heaviest first (key counts)
    gluon_work, chunk_work, rest = None, None, None
    if gluon_ok:
        fresh = fresh_long_prompts(qsl, md.seq_lens_cpu, GLUON_MIN_QUERY)
        chunks = long_prefix_chunks(qsl, md.seq_lens_cpu) if chunks_ok else [False] * len(fresh)
        if any(fresh):
            gluon_work = prefill_work(qsl, GLUON_TILE.block_m, False, device, md.seq_lens_cpu, only=fresh)
        if any(chunks):
            chunk_work = prefill_work(qsl, GLUON_CHUNK_TILE.block_m, False, device, md.seq_lens_cpu, only=chunks)
        if any(fresh) or any(chunks):
            rest = [not (f or c) for f, c in zip(fresh, chunks, strict=True)]
    work = prefill_work(qsl, tile[0], mixed, device, seq_lens, only=rest)
    md.plans["triton_prefill"] = plan = PrefillPlan(mixed, kernel, tile, work, gluon_work, chunk_work,
                                                    decode_splits)
    return plan


def _shared_prefix_plan(md: AttentionMetadata, q: torch.Tensor,
                        kv_cache: torch.Tensor) -> sp.SharedPrefixTensors | None:
    """The step's shared-prefix pass over its decode rows, planned by the first layer from the host block tables
    (or put in `md.plans` by whoever built the metadata: a captured step's static buffers, or None)."""
    if sp.PLAN_KEY in md.plans:
        plan = md.plans[sp.PLAN_KEY]
        return plan if isinstance(plan, sp.SharedPrefixTensors) else None
    tensors = None
    if sp.ENABLED and md.block_tables_cpu is not None:
        qsl = np.asarray(md.query_start_loc_cpu)
        hq, hkv = q.shape[1], kv_cache.shape[3]
        host = sp.plan_shared_prefixes(md.block_tables_cpu, np.asarray(md.seq_lens_cpu), np.diff(qsl) == 1,
                                       kv_cache.shape[2], members_per_item(hq, hkv))
        if host is not None:
            tensors = sp.plan_to_device(host, hq, q.shape[2], q.device, non_blocking=q.device.type == "cuda")
    md.plans[sp.PLAN_KEY] = tensors
    return tensors


# a work entry that no program acts on: its query tile starts past every sequence's query (tile * BLOCK_M >= q_len)
_IDLE_TILE = 1 << 20


class CapturedPrefill:
    """The prefill plan of captured mixed steps (`kvfleet.engine.mixed_graphs`): one tile for every step and a
    work list of fixed capacity per token bucket, refilled before each replay from the step's host lists, the
    unused entries idle. A captured step is always planned as mixed (the decode kernel runs after the prefill
    one and finds nothing to do when no sequence decodes). Its prompts (or chunks) are short queries, of up to
    `SHORT_QUERY_MAX_TOKENS` each, whatever the bucket: the tile eager steps of such prompts take; a step with a
    longer one runs eagerly (the Gluon kernel's prompts among them), its launches small beside its GPU work."""

    def __init__(self, max_tokens: int, max_prefill_seqs: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kernel = _triton_kernel(PREFILL_KERNEL)   # captured steps never run the Gluon kernel
        self.max_query = min(max_tokens, SHORT_QUERY_MAX_TOKENS)
        self.tile = _prefill_tile(self.kernel, self.max_query, dtype)
        self.max_prefill_seqs = max_prefill_seqs
        self.work = torch.zeros((self.capacity(max_tokens), 2), dtype=torch.int32, device=device)
        self.work[:, 1] = _IDLE_TILE

    def capacity(self, num_tokens: int) -> int:
        """Work entries of a bucket of `num_tokens`: every tile of its tokens plus one partial tile per prompt."""
        return -(-num_tokens // self.tile[0]) + self.max_prefill_seqs

    def plan(self, num_tokens: int) -> PrefillPlan:
        """The plan a bucket's graph is captured with (put it in the captured metadata's `plans`)."""
        return PrefillPlan(True, self.kernel, self.tile, self.work[:self.capacity(num_tokens)])

    def fits(self, md: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the step's work fits the bucket's list."""
        qsl, bm = md.query_start_loc_cpu, self.tile[0]
        lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        prompts = [n for n in lens if n > 1]
        return (len(prompts) <= self.max_prefill_seqs and max(prompts, default=0) <= self.max_query
                and sum(-(-n // bm) for n in prompts) <= self.capacity(num_tokens))

    def load(self, md: AttentionMetadata, num_tokens: int) -> None:
        """Write the step's work list (`fits` checked) into the bucket's entries, the rest idle; no host wait."""
        cap = self.capacity(num_tokens)
        rows = np.zeros((cap, 2), dtype=np.int32)
        rows[:, 1] = _IDLE_TILE
        pairs = prefill_work_pairs(md.query_start_loc_cpu, self.tile[0], True,
                                   md.seq_lens_cpu if self.kernel != "v1" else None)
        rows.reshape(-1)[:len(pairs)] = pairs
        host = torch.from_numpy(rows)
        if self.work.device.type == "cuda":
            host = host.pin_memory()   # a pageable copy would wait for the previous step's kernels
        self.work[:cap].copy_(host, non_blocking=True)


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    rotary: Rotary | None = None,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; normalises each head of q and k by `qk_norm` and rotates
    them by `rotary` when given (q in place), writes k/v into kv_cache, then attends."""
    md = attn_metadata
    plan = _prefill_plan(md, q, k, v, kv_cache) if md.max_query_len > 1 else None
    # v2: the step's new keys and values are read from k/v themselves, by TMA (Hopper); where TMA does not apply,
    # pointer loads of k/v would only save the block-table lookups: not used (the sweep's "contiguous kv" rows
    # measure it). k must then hold the rotated keys, as the cache does; so must it for the Gluon kernel (its
    # paged form reads the cache, rotated as written).
    new_kv = (plan is not None and plan.kernel == "v2" and k.dtype == kv_cache.dtype
                and tma_applies(k, v, plan.tile[1]))
    gluon_work = plan.gluon_work if plan is not None else None
    if rotary is not None and FUSED_ROTARY_CACHE:   # the norm, the rotation and the cache write: one kernel
        rotary_and_cache(q, k, v, rotary.cos, rotary.sin, kv_cache, md.slot_mapping,
                         rotate_k=new_kv or gluon_work is not None,
                         q_norm_weight=qk_norm.q_weight if qk_norm is not None else None,
                         k_norm_weight=qk_norm.k_weight if qk_norm is not None else None,
                         norm_eps=qk_norm.eps if qk_norm is not None else 1e-6)
    else:
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm.q_weight, qk_norm.eps), rms_norm(k, qk_norm.k_weight, qk_norm.eps)
        if rotary is not None:
            apply_rotary_cos_sin(q, k, rotary.cos, rotary.sin)
        if k.dtype != kv_cache.dtype:
            k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
        reshape_and_cache(k, v, kv_cache, md.slot_mapping)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = md.seq_lens.shape[0]
    shared = _shared_prefix_plan(md, q, kv_cache)
    if shared is not None:
        shared_prefix_attention(q, kv_cache, md.block_tables, md.query_start_loc, shared.items, shared.members,
                                shared.part_out, shared.part_lse, scale)
    decode_shared = SharedPrefixArgs(shared.kv_start, shared.part_out, shared.part_lse) if shared is not None else None
    if plan is None:
        split = choose_decode_split(batch, kv_cache.shape[3], md.max_seq_len, _num_sms(q.device))
        return paged_decode_attention(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                      scale, out, num_splits=split.num_splits,
                                      merge="kernel" if shared or split.direct_single else None,
                                      split_tokens=split.split_tokens, shared=decode_shared,
                                      direct_single=split.direct_single)
    mixed, kernel, work = plan.mixed, plan.kernel, plan.work
    block_m, block_n, warps, stages = plan.tile
    args = (q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, scale, out)
    if gluon_work is not None:   # the fresh long prompts' rows; the Triton kernel below has the other prompts'
        g = GLUON_TILE
        prefill_attention_gluon(q, k, v, md.query_start_loc, md.max_query_len, scale, out, work=gluon_work,
                                block_m=g.block_m, block_n=g.block_n, num_buffers=g.num_buffers,
                                num_warps=g.num_warps, s_ahead=g.s_ahead, warp_specialize=g.warp_specialize,
                                consumers=g.consumers, pingpong=g.pingpong, pages_at_once=g.pages_at_once)
    if plan.gluon_chunk_work is not None:   # chunks over a cached prefix: every key from the cache (written above)
        c = GLUON_CHUNK_TILE
        prefill_attention_gluon_paged(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                      md.max_query_len, scale, out, work=plan.gluon_chunk_work, block_m=c.block_m,
                                      block_n=c.block_n, num_buffers=c.num_buffers, num_warps=c.num_warps,
                                      s_ahead=c.s_ahead, warp_specialize=c.warp_specialize,
                                      consumers=c.consumers, pingpong=c.pingpong, pages_at_once=c.pages_at_once)
    if kernel != "v1":
        prefill_attention_v2(*args, skip_decode=mixed, block_m=block_m, block_n=block_n, work=work,
                             num_warps=warps, num_stages=stages, k=k if new_kv else None,
                             v=v if new_kv else None, cache_stages=stages + PREFILL_CACHE_EXTRA_STAGES)
    else:
        prefill_attention(*args, skip_decode=mixed, block_m=block_m, block_n=block_n, work=work,
                          num_warps=warps, num_stages=stages)
    if mixed:
        # the decode rows, split by their own count and lengths (a few long contexts beside a chunk would
        # otherwise leave most SMs idle); with a shared-prefix pass, unsplit (its variants stay few)
        splits = plan.decode_splits if shared is None else 1
        paged_decode_attention(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale, out,
                               num_splits=splits, shared=decode_shared)
    return out


def mixed_split_warmup_batches(device: torch.device, num_kv_heads: int, context_len: int,
                               max_decodes: int) -> dict[int, int]:
    """`mixed_split_batches` on this device: for each split count an eager mixed step's decode rows can get, the
    fewest rows of `context_len` keys that give it (the warm-up's waves)."""
    return mixed_split_batches(num_kv_heads, context_len, _num_sms(device), max_decodes)
