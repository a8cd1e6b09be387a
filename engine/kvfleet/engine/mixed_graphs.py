"""CUDA graphs for steps with prefill: mixed steps (new prompts or chunks beside decodes) and prefill steps of up
to a few thousand tokens.

Such a step run eagerly costs the host ~1 ms a layer to launch on the H200's host (issue 16: 36 ms for a
Llama-3.1-8B step of one 1,024-token prompt and 12 decodes, whose GPU work is ~25 ms), so at moderate load
every step with a new prompt waited on Python, not on the GPU. Here one graph of the whole forward is captured
per token bucket (every 64 tokens up to 2,048, every 512 above, up to the limit), largest first, in the decode
graphs' memory pool, reading static buffers; a step copies its inputs into them and replays the smallest bucket
that holds it:

* padding tokens (past the step's own) have slot -1 (nothing written to the cache) and belong to no sequence:
  the attention kernels never touch their rows, whose outputs nobody reads;
* padding sequences have no query tokens and context 0: both attention kernels skip them;
* the prefill kernel's work list has a fixed capacity per bucket (`CapturedPrefill`), refilled from the step's
  host lists before each replay, its unused entries idle; its tile is the short queries' one for all buckets.

Only steps that fit (tokens, sequences, prompts of up to 2,048 tokens each, work entries, block-table width)
replay; the rest, and every step beyond the limit (long prompts or chunks, where the GPU work dwarfs the
launches, and the Gluon kernel takes the fresh ones), run eagerly.
KVFLEET_MIXED_CUDA_GRAPHS (`cuda_graphs.mixed_graph_limit`): the largest bucket in tokens (default 8192, capped
by the step budget; 0 turns them off). Single process only: under tensor parallelism steps with prefill stay
eager. Where graphs exist the warm-up also runs every step shape eagerly (`kvfleet.engine.warmup`), for the steps
that fit no bucket.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.attention.triton_backend import CapturedPrefill, triton_paged_attention
from kvfleet.engine.models.base import CausalLM

BUCKET_TOKENS = 64          # bucket granularity: at most 63 padding tokens (~6 % of a 1k-token step)
FINE_BUCKETS_UP_TO = 2048   # above it, coarser buckets: a step there is GPU work of >= ~50 ms on an 8B model
COARSE_BUCKET_TOKENS = 512  # at most 511 padding tokens above FINE_BUCKETS_UP_TO (< 25 %; a full step: none)
MAX_PREFILL_SEQS = 64       # prompts (or chunks) a captured step may hold


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens` rounded up to its granularity (none for 0): every BUCKET_TOKENS up to
    FINE_BUCKETS_UP_TO, every COARSE_BUCKET_TOKENS above (8,192 tokens: 32 + 12 graphs, not 128)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens: must be >= 0, got {max_tokens}")
    fine_top = _round_up(min(max_tokens, FINE_BUCKETS_UP_TO), BUCKET_TOKENS)
    sizes = list(range(BUCKET_TOKENS, fine_top + 1, BUCKET_TOKENS))
    if max_tokens > FINE_BUCKETS_UP_TO:
        top = FINE_BUCKETS_UP_TO + _round_up(max_tokens - FINE_BUCKETS_UP_TO, COARSE_BUCKET_TOKENS)
        sizes += list(range(FINE_BUCKETS_UP_TO + COARSE_BUCKET_TOKENS, top + 1, COARSE_BUCKET_TOKENS))
    return sizes


def pick_token_bucket(sizes: list[int], n: int) -> int | None:
    """The smallest bucket holding `n` tokens, None when none does."""
    i = bisect.bisect_left(sizes, max(n, 1))
    return sizes[i] if i < len(sizes) else None


class MixedStepBuffers:
    """The static inputs of captured steps with prefill, and how a step's inputs are copied into them.

    Separate from the graphs so the padding can be checked on any device: the metadata of a bucket (`metadata`)
    run eagerly after `load` gives the step's rows exactly as its own metadata does."""

    def __init__(self, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.sizes = mixed_graph_sizes(max_tokens)
        if not self.sizes:
            raise ValueError("max_tokens: no bucket to capture")
        top = self.sizes[-1]
        self.max_seqs = max(1, min(top, max_seqs))
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(self.max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(self.max_seqs, self.max_blocks, dtype=torch.int32, device=device)
        self.prefill = CapturedPrefill(top, min(MAX_PREFILL_SEQS, self.max_seqs), dtype, device)

    def seq_cap(self, bucket: int) -> int:
        return min(bucket, self.max_seqs)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The metadata a bucket's graph is captured with: views of the static buffers, the captured prefill plan."""
        s = self.seq_cap(bucket)
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc[:s + 1],
            seq_lens=self.seq_lens[:s], block_tables=self.block_tables[:s],
            max_query_len=bucket, max_seq_len=self.max_model_len,
            query_start_loc_cpu=[0] * (s + 1), seq_lens_cpu=[0] * s)
        md.plans["triton_prefill"] = self.prefill.plan(bucket)
        return md

    def bucket_for(self, num_tokens: int, md: AttentionMetadata) -> int | None:
        """The bucket that holds this step with prefill, None when it must run eagerly."""
        if md.max_query_len <= 1:
            return None
        bucket = pick_token_bucket(self.sizes, num_tokens)
        if (bucket is None or md.num_seqs > self.seq_cap(bucket) or md.block_tables.shape[1] > self.max_blocks
                or md.max_seq_len > self.max_model_len or not self.prefill.fits(md, bucket)):
            return None
        return bucket

    def load(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """Copy the step's inputs into the bucket's buffers and pad the rest (stream-ordered, no host wait)."""
        n, s, width = input_ids.shape[0], md.num_seqs, md.block_tables.shape[1]
        cap = self.seq_cap(bucket)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.query_start_loc[:s + 1].copy_(md.query_start_loc, non_blocking=True)
        self.seq_lens[:s].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:s, :width].copy_(md.block_tables, non_blocking=True)
        if bucket > n:
            self.slot_mapping[n:bucket].fill_(-1)
            self.positions[n:bucket].zero_()
            self.input_ids[n:bucket].zero_()
        if cap > s:
            self.query_start_loc[s + 1:cap + 1].fill_(n)   # padding sequences: no query tokens
            self.seq_lens[s:cap].zero_()
        self.prefill.load(md, bucket)


class MixedGraphs:
    """Captured forwards of steps with prefill, one per token bucket, over `kv_caches`."""

    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], max_tokens: int, max_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device: CUDA graphs need a CUDA device, got {device}")
        if model.attention_fn is not triton_paged_attention:
            raise ValueError("attention: captured steps with prefill need the Triton attention backend")
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = MixedStepBuffers(max_tokens, max_seqs, max_model_len, block_size, kv_caches[0].dtype, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def sizes(self) -> list[int]:
        return self.buffers.sizes

    @torch.inference_mode()
    def capture(self, pool: Any, stream: torch.cuda.Stream, capture_error_mode: str = "global") -> Any:
        """Capture every bucket, largest first, into `pool` (None: a new one); returns the pool."""
        buf = self.buffers
        for bucket in reversed(buf.sizes):
            md = buf.metadata(bucket)
            args = (buf.input_ids[:bucket], buf.positions[:bucket], self.kv_caches, md)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):   # compile Triton variants and settle the allocator outside the graph
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
                out = self.model(*args)
            if pool is None:
                pool = graph.pool()
            self.graphs[bucket] = graph
            self.outputs[bucket] = out
        return pool

    def can_run(self, num_tokens: int, md: AttentionMetadata) -> bool:
        return bool(self.graphs) and self.buffers.bucket_for(num_tokens, md) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bucket = self.buffers.bucket_for(n, md)
        if bucket is None or bucket not in self.graphs:
            raise ValueError("attn_metadata: step not capturable (check can_run first)")
        self.buffers.load(bucket, input_ids, positions, md)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]

