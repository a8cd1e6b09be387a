"""CUDA graphs for decode steps (and, through `kvfleet.engine.mixed_graphs`, for steps with prefill).

At start, one graph of the model's forward is captured per padded batch size
up to ``max_num_seqs``, largest first, all in one
memory pool, reading static input buffers. A decode step of ``n`` sequences
copies its inputs into the buffers of the smallest bucket ``>= n`` (padding rows:
slot -1 so nothing is written, context length 0 so nothing is read) and replays
that graph: one launch instead of hundreds of kernel launches from Python.
Batches beyond the largest bucket run eagerly; so do steps with prefill, unless the runner was built with
captured mixed steps (`mixed_graphs.MixedGraphs`, sharing the pool), which then replay when they fit.

Padded batch sizes: 1, 2, 4, 8, every 16 to 256, every 32 to 512, every 64 beyond. Sizes of 16 and more are
captured a second time with the shared-prefix pass (`attention.shared_prefix`: decode rows that share leading
KV blocks read them once per group) over static plan buffers; a step replays that variant when its plan finds
a shared prefix, the plain one otherwise, so steps with nothing shared pay nothing for it.

A graph fixes the decode kernel's split count, chosen for contexts of up to ``max_model_len`` keys. With
KVFLEET_DECODE_LONG_SPLIT = L on, that is two splits at every size the batch alone leaves at one, which long
contexts gain from and short ones pay for; those sizes are captured a second time for contexts of up to L keys
(one split), replayed while a step's longest context fits (`short_context_sizes`). Either graph is right for
any length: the split count only spreads the work.
The model executors (``kvfleet.engine.model_executor``) capture it on CUDA and replay it through
``can_run(num_tokens, attn_metadata)`` and ``run(input_ids, positions, kv_caches, attn_metadata)``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvfleet.engine.attention import shared_prefix as sp
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.distributed import parallel_state
from kvfleet.engine.env_settings import EnvSettingError
from kvfleet.engine.kernels import paged_decode
from kvfleet.engine.models.base import CausalLM

if TYPE_CHECKING:
    from kvfleet.engine.mixed_graphs import MixedGraphs

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16 to 256, every 32 to 512, every 64
    beyond, and ``max_batch`` itself (padding stays under ~7% while the capture stays short)."""
    if max_batch < 1:
        raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, min(max_batch, 256) + 1, 16))
    sizes += list(range(288, min(max_batch, 512) + 1, 32))
    sizes += list(range(576, max_batch + 1, 64))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def tp_graph_mode() -> str:
    """Decode graphs under tensor parallelism, from KVFLEET_TP_CUDA_GRAPHS: "full" (1, the default:
    whole forwards, all-reduces inside), "piecewise" (graphs cut at the all-reduces, which run eagerly
    between the parts) or "eager" (0)."""
    raw = os.environ.get("KVFLEET_TP_CUDA_GRAPHS", "1")
    modes = {"0": "eager", "1": "full", "piecewise": "piecewise"}
    if raw not in modes:
        raise EnvSettingError(f"KVFLEET_TP_CUDA_GRAPHS: '0', '1' or 'piecewise', got {raw!r}")
    return modes[raw]


DEFAULT_MIXED_GRAPH_LIMIT = 8192


def mixed_graph_limit() -> int:
    """KVFLEET_MIXED_CUDA_GRAPHS: the largest captured step in tokens (default 8192, `kvfleet serve`'s whole step
    budget; 0 = none). Issue 16, lease 29 (H200): the 300-at-once burst's TTFT p50 1.5 % lower than with 2,048 in all
    five alternated pairs, start to healthy ~3 s longer (44 graphs, not 32)."""
    raw = os.environ.get("KVFLEET_MIXED_CUDA_GRAPHS", "").strip() or str(DEFAULT_MIXED_GRAPH_LIMIT)
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0 or n > 65536:
        raise EnvSettingError(f"KVFLEET_MIXED_CUDA_GRAPHS: expected a token count in [0, 65536], got {raw!r}")
    return n


SHARED_PREFIX_MIN_BATCH = 16   # the smallest captured batch with a shared-prefix variant


def short_context_sizes(sizes: list[int], num_kv_heads: int, max_model_len: int, num_sms: int,
                        long_split: int) -> list[int]:
    """The batch sizes whose decode kernel splits differently while no context exceeds `long_split` keys than when
    one may reach `max_model_len`: those that get a graph for short contexts ([] when the long split is off)."""
    if not 0 < long_split < max_model_len:
        return []
    return [bs for bs in sizes
            if paged_decode.choose_decode_split(bs, num_kv_heads, long_split, num_sms, long_split)
            != paged_decode.choose_decode_split(bs, num_kv_heads, max_model_len, num_sms, long_split)]


def pick_bucket(sizes: list[int], n: int) -> int | None:
    """Smallest captured size that holds ``n`` sequences, or None when ``n`` is too large."""
    for s in sizes:
        if s >= n:
            return s
    return None


class PiecewiseGraph:
    """One forward captured as several graphs cut at its tensor-parallel all-reduces: `replay()`
    replays each part, then runs the all-reduce that ended it eagerly, so no collective is ever inside
    a graph (for setups where capturing one hangs). All parts share the runner's memory pool and are
    always replayed in capture order, as a pool shared by several graphs requires."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = []

    def capture(self, fn: Any, pool: Any, stream: torch.cuda.Stream, capture_error_mode: str) -> Any:
        current = [torch.cuda.CUDAGraph()]

        def cut(x: torch.Tensor) -> torch.Tensor:
            current[0].capture_end()
            self.parts.append((current[0], x))    # x: written by this part, summed before the next
            current[0] = torch.cuda.CUDAGraph()
            current[0].capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            return x

        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            current[0].capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                with parallel_state.all_reduce_cut(cut):
                    out = fn()
            finally:
                current[0].capture_end()
            self.parts.append((current[0], None))
        return out

    def replay(self) -> None:
        for graph, x in self.parts:
            graph.replay()
            if x is not None:
                parallel_state.tp_all_reduce_now(x)


class CudaGraphRunner:
    """Captured decode forwards of ``model`` over ``kv_caches``, one per padded batch size."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_batch: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device: CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.device = device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        # one token per sequence: query_start_loc is 0..n, never changes
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, Any] = {}   # CUDAGraph or PiecewiseGraph, each with replay()
        self.outputs: dict[int, torch.Tensor] = {}
        # the shared-prefix variants, by size (Triton attention, one rank: only there are host tables at hand)
        self.shared: sp.SharedPrefixBuffers | None = None
        self.shared_graphs: dict[int, Any] = {}
        self.shared_outputs: dict[int, torch.Tensor] = {}
        self.members_per_item = 1
        self.shared_replays = 0   # decode steps replayed with the shared-prefix pass
        # the sizes captured again for contexts of up to `short_len` keys (`short_context_sizes`)
        self.short_len = 0
        self.short_sizes: list[int] = []
        self.short_graphs: dict[int, Any] = {}
        self.short_outputs: dict[int, torch.Tensor] = {}
        self.short_replays = 0    # decode steps replayed with those
        self.pool: Any = None
        self.mixed: MixedGraphs | None = None   # steps with prefill, captured after the decode graphs when set

    def enable_shared_prefix(self, num_q_heads: int, members_per_item: int) -> None:
        """Capture the shared-prefix variants too (before `capture`): `num_q_heads` of this rank, and the
        sequences one work item takes (`kernels.shared_prefix.members_per_item`)."""
        kv = self.kv_caches[0]
        self.shared = sp.SharedPrefixBuffers(self.sizes[-1], num_q_heads, kv.shape[4], self.device)
        self.members_per_item = members_per_item

    def enable_short_contexts(self, num_sms: int, long_split: int) -> None:
        """Capture the sizes whose split count differs for contexts of up to `long_split` keys a second time
        (before `capture`; nothing when the long split is off)."""
        kv = self.kv_caches[0]
        self.short_sizes = short_context_sizes(self.sizes, kv.shape[3], self.max_model_len, num_sms, long_split)
        self.short_len = long_split if self.short_sizes else 0

    def _metadata(self, bs: int, shared: bool = False, max_seq_len: int | None = None) -> AttentionMetadata:
        # max_seq_len (max_model_len unless given) fixes the decode kernel's split count for every replay
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=max_seq_len or self.max_model_len,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[1] * bs,
        )
        md.plans[sp.PLAN_KEY] = self.shared.tensors(bs) if shared and self.shared is not None else None
        return md

    def _shared_sizes(self) -> list[int]:
        return [bs for bs in self.sizes if bs >= SHARED_PREFIX_MIN_BATCH] if self.shared is not None else []

    @torch.inference_mode()
    def capture(self, capture_error_mode: str = "global", piecewise: bool = False) -> None:
        """`piecewise`: each size as a PiecewiseGraph (tensor parallelism without captured collectives)."""
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Padding state during capture: every row writes nothing and reads one cached token.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream(self.device)
        shared_sizes = [] if piecewise else self._shared_sizes()
        variants = ([(bs, "plain") for bs in self.sizes] + [(bs, "shared") for bs in shared_sizes]
                    + [(bs, "short") for bs in self.short_sizes])
        graphs = {"plain": self.graphs, "shared": self.shared_graphs, "short": self.short_graphs}
        outputs = {"plain": self.outputs, "shared": self.shared_outputs, "short": self.short_outputs}
        for bs, kind in sorted(variants, key=lambda v: v[0], reverse=True):   # largest first: the pool fits all
            md = self._metadata(bs, kind == "shared", self.short_len if kind == "short" else None)
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, md)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and let allocators settle outside the graph
                    self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if piecewise:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                pieces = PiecewiseGraph()
                out = pieces.capture(functools.partial(self.model, *args), self.pool, stream, capture_error_mode)
                graphs[kind][bs] = pieces
            else:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=capture_error_mode):
                    out = self.model(*args)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs[kind][bs] = graph
            outputs[kind][bs] = out
        self.seq_lens.zero_()
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d decode CUDA graphs (batch %d..%d; %d more with the shared-prefix pass, %d for "
                    "contexts of up to %d keys) in %.1fs, %.0f MiB", len(self.graphs), self.sizes[0], self.sizes[-1],
                    len(self.shared_graphs), len(self.short_graphs), self.short_len, time.monotonic() - start,
                    used / 2**20)
        if self.mixed is not None and not piecewise:
            start, free_before = time.monotonic(), torch.cuda.mem_get_info(self.device)[0]
            self.pool = self.mixed.capture(self.pool, stream, capture_error_mode)
            torch.cuda.synchronize(self.device)
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("captured %d CUDA graphs of steps with prefill (%d..%d tokens) in %.1fs, %.0f MiB",
                        len(self.mixed.graphs), self.mixed.sizes[0], self.mixed.sizes[-1],
                        time.monotonic() - start, used / 2**20)

    def release(self) -> None:
        """Destroy the graphs now, whoever else still holds this runner: under tensor parallelism NCCL's
        teardown waits for every graph that captured its communicator."""
        self.graphs.clear()
        self.outputs.clear()
        self.shared_graphs.clear()
        self.shared_outputs.clear()
        self.short_graphs.clear()
        self.short_outputs.clear()
        if self.mixed is not None:
            self.mixed.graphs.clear()
            self.mixed.outputs.clear()
            self.mixed = None
        self.pool = None
        torch.cuda.synchronize(self.device)

    def can_run(self, num_tokens: int, attn_metadata: AttentionMetadata) -> bool:
        md = attn_metadata
        if md.max_query_len > 1:
            return self.mixed is not None and self.mixed.can_run(num_tokens, md)
        return (bool(self.graphs) and md.max_query_len == 1 and num_tokens == md.num_seqs
                and num_tokens <= self.sizes[-1] and md.block_tables.shape[1] <= self.max_blocks
                and md.max_seq_len <= self.max_model_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            attn_metadata: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        same_caches = kv_caches is self.kv_caches or all(
            a.data_ptr() == b.data_ptr() for a, b in zip(kv_caches, self.kv_caches, strict=True))
        if attn_metadata.max_query_len > 1 and self.mixed is not None:
            if not same_caches:
                raise ValueError("kv_caches: not the caches the graphs were captured over")
            return self.mixed.run(input_ids, positions, attn_metadata)
        bs = pick_bucket(self.sizes, n)
        if bs is None or not same_caches:
            raise ValueError("attn_metadata: batch not capturable (check can_run first) or KV cache replaced")
        md = attn_metadata
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        plan = self._shared_plan(md, bs)
        if plan is not None and self.shared is not None:
            self.shared.load(plan, bs)
            self.shared_graphs[bs].replay()
            self.shared_replays += 1
            return self.shared_outputs[bs][:n]
        if bs in self.short_graphs and md.max_seq_len <= self.short_len:
            self.short_graphs[bs].replay()
            self.short_replays += 1
            return self.short_outputs[bs][:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def _shared_plan(self, md: AttentionMetadata, bs: int) -> sp.SharedPrefixPlan | None:
        """The step's shared-prefix plan when bucket `bs` has that variant (pure decode: every row decodes)."""
        if bs not in self.shared_graphs or md.block_tables_cpu is None or not sp.ENABLED:
            return None
        n = md.num_seqs
        return sp.plan_shared_prefixes(md.block_tables_cpu, np.asarray(md.seq_lens_cpu), np.ones(n, dtype=bool),
                                       self.block_size, self.members_per_item,
                                       max_items=sp.SharedPrefixBuffers.capacity(bs))


def build_graph_runner(model: CausalLM, kv_caches: list[torch.Tensor], max_num_seqs: int, max_model_len: int,
                       block_size: int, device: torch.device, mixed_max_tokens: int = 0) -> CudaGraphRunner | None:
    """Capture decode graphs on CUDA, and steps with prefill of up to `mixed_max_tokens` tokens (0: none; they
    need the Triton attention backend); None elsewhere (the runner then stays eager)."""
    if device.type != "cuda":
        return None
    runner = CudaGraphRunner(model, kv_caches, max_num_seqs, max_model_len, block_size, device)
    from kvfleet.engine.attention.triton_backend import triton_paged_attention
    from kvfleet.engine.kernels.shared_prefix import members_per_item

    if sp.ENABLED and model.attention_fn is triton_paged_attention and parallel_state.get_tp_size() == 1:
        hq, hkv = model.config.num_heads, kv_caches[0].shape[3]
        runner.enable_shared_prefix(hq, members_per_item(hq, hkv))
    if model.attention_fn is triton_paged_attention:
        runner.enable_short_contexts(torch.cuda.get_device_properties(device).multi_processor_count,
                                     paged_decode.DEFAULT_LONG_SPLIT)
    if mixed_max_tokens > 0:
        from kvfleet.engine.mixed_graphs import MixedGraphs

        if model.attention_fn is triton_paged_attention:
            runner.mixed = MixedGraphs(model, kv_caches, mixed_max_tokens, max_num_seqs, max_model_len, block_size,
                                       device)
        else:
            logger.info("steps with prefill run eagerly: captured ones need the Triton attention backend")
    runner.capture()
    return runner
