"""Captured steps with prefill (`kvfleet.engine.mixed_graphs`): the buckets, and the padding a replay relies on.

The graphs themselves need a GPU (bench/gpu_host_profile.py times them); what a replay computes is the eager
forward over a bucket's static metadata, which runs here under Triton's interpreter: the step's rows and the KV
cache must come out as the step's own metadata gives them, whatever the padding holds."""

import pytest
import torch

from kvfleet.engine.attention import AttentionMetadata, build_attention_metadata, triton_backend
from kvfleet.engine.attention.triton_backend import triton_paged_attention
from kvfleet.engine.cuda_graphs import mixed_graph_limit
from kvfleet.engine.mixed_graphs import BUCKET_TOKENS, MixedStepBuffers, mixed_graph_sizes, pick_token_bucket

from .paged import metadata_step, rel_err

BLOCK = 8


def test_buckets_every_64_tokens_up_to_the_limit() -> None:
    sizes = mixed_graph_sizes(2048)
    assert sizes[0] == BUCKET_TOKENS == 64 and sizes[-1] == 2048 and len(sizes) == 32
    assert mixed_graph_sizes(100) == [64, 128] and mixed_graph_sizes(0) == []
    for n in range(1, 2049):
        b = pick_token_bucket(sizes, n)
        assert b is not None and n <= b < n + 64
    assert pick_token_bucket(sizes, 2049) is None and pick_token_bucket([], 5) is None
    with pytest.raises(ValueError, match="max_tokens"):
        mixed_graph_sizes(-1)


def test_buckets_every_512_tokens_above_2048() -> None:
    sizes = mixed_graph_sizes(8192)
    assert len(sizes) == 32 + 12 and sizes[31] == 2048 and sizes[32:] == list(range(2560, 8193, 512))
    assert mixed_graph_sizes(2100)[-2:] == [2048, 2560]
    for n in range(2049, 8193):
        b = pick_token_bucket(sizes, n)
        assert b is not None and n <= b < n + 512
    assert pick_token_bucket(sizes, 8192) == 8192 and pick_token_bucket(sizes, 8193) is None


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_MIXED_CUDA_GRAPHS", raising=False)
    assert mixed_graph_limit() == 8192   # with --max-num-batched-tokens 8192: every step of `kvfleet serve`
    monkeypatch.setenv("KVFLEET_MIXED_CUDA_GRAPHS", "0")
    assert mixed_graph_limit() == 0
    for bad in ("-5", "lots", "100000"):
        monkeypatch.setenv("KVFLEET_MIXED_CUDA_GRAPHS", bad)
        with pytest.raises(ValueError, match="KVFLEET_MIXED_CUDA_GRAPHS"):
            mixed_graph_limit()


def _step(gen: torch.Generator, q_lens: list[int], seq_lens: list[int]) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    return metadata_step(gen, q_lens, seq_lens, BLOCK, extra_blocks=4)


def _padded(x: torch.Tensor, rows: int, gen: torch.Generator) -> torch.Tensor:
    """x with garbage rows appended up to `rows` (what a replay's padding rows hold)."""
    extra = 1e3 * torch.randn(rows - x.shape[0], *x.shape[1:], generator=gen)
    return torch.cat([x, extra])


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 7, 1], [30, 9, 7, 50]),        # a fresh prompt beside decodes
    ([20, 1, 13], [20, 41, 60]),           # a chunk after a cached prefix, a decode, a fresh prompt
    ([33, 20], [33, 20]),                  # prefill only, no decode
    ([64], [100]),                         # the bucket exactly full, over a cached prefix
])
@pytest.mark.parametrize("kernel", ["v1", "v2", "v2-paged"])
def test_a_padded_step_attends_as_its_own_metadata(q_lens: list[int], seq_lens: list[int], kernel: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "PREFILL_KERNEL", kernel)
    gen = torch.Generator().manual_seed(7)
    q, k, v, cache, md = _step(gen, q_lens, seq_lens)
    n = q.shape[0]
    bufs = MixedStepBuffers(128, 16, 128, BLOCK, torch.float32, torch.device("cpu"))
    bucket = bufs.bucket_for(n, md)
    assert bucket == (64 if n <= 64 else 128)
    # stale state from an earlier, larger step must not leak into this one
    bufs.slot_mapping.fill_(3)
    bufs.query_start_loc.fill_(0)
    bufs.seq_lens.fill_(77)
    bufs.block_tables.fill_(1)
    bufs.load(bucket, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), md)
    padded_md = bufs.metadata(bucket)
    cache_pad, q_pad = cache.clone(), _padded(q, bucket, gen)
    out_pad = triton_paged_attention(q_pad, _padded(k, bucket, gen), _padded(v, bucket, gen), cache_pad,
                                     padded_md, 0.25)
    out = triton_paged_attention(q, k, v, cache, md, 0.25)
    assert torch.equal(cache_pad, cache)            # padding rows wrote nothing
    assert rel_err(out_pad[:n], out) < 1e-6
    assert padded_md.plans["triton_prefill"].mixed   # type: ignore[attr-defined]


def test_steps_that_do_not_fit_run_eagerly() -> None:
    bufs = MixedStepBuffers(128, 16, 64, BLOCK, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    decode = _step(gen, [1, 1], [5, 9])[4]
    assert bufs.bucket_for(2, decode) is None                       # decode steps are the decode graphs'
    too_long = _step(gen, [100, 40], [100, 40])[4]
    assert bufs.bucket_for(140, too_long) is None                   # past the largest bucket
    too_many = _step(gen, [2] * 17, [2] * 17)[4]
    assert bufs.bucket_for(34, too_many) is None                    # more sequences than a bucket holds
    too_wide = _step(gen, [3, 1], [3, 70])[4]
    assert bufs.bucket_for(4, too_wide) is None                     # context past max_model_len
    ok = _step(gen, [3, 1], [3, 60])[4]
    assert bufs.bucket_for(4, ok) == 64


def test_a_padded_model_step_gives_the_same_rows(tmp_path) -> None:
    """A tiny Llama through the Triton attention: a mixed step over a bucket's padded metadata gives the step's
    own hidden rows and KV cache."""
    from kvfleet.engine.config import EngineConfig
    from kvfleet.engine.llm_engine import LLMEngine
    from kvfleet.engine.testing import make_tiny_model

    path = make_tiny_model("llama", tmp_path)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                                 max_model_len=256, max_num_seqs=8))
    model = eng.runner.executor.model
    model.attention_fn = triton_paged_attention
    for layer in model.model.layers:
        layer.self_attn.attention_fn = triton_paged_attention
    caches = eng.runner.kv_caches
    for c in caches:
        c.normal_()
    q_lens, seq_lens = [1, 9, 1], [20, 9, 33]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9]]
    md = build_attention_metadata(q_lens, seq_lens, tables, eng.runner.block_size)
    ids = torch.tensor([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11])
    pos = torch.tensor([19, 0, 1, 2, 3, 4, 5, 6, 7, 8, 32])
    before = [c.clone() for c in caches]
    with torch.inference_mode():
        ref = model(ids, pos, caches, md)
        after_ref = [c.clone() for c in caches]
        for c, b in zip(caches, before, strict=True):
            c.copy_(b)
        bufs = MixedStepBuffers(64, 8, 256, eng.runner.block_size, torch.float32, torch.device("cpu"))
        bucket = bufs.bucket_for(11, md)
        assert bucket == 64
        bufs.load(bucket, ids, pos, md)
        out = model(bufs.input_ids[:bucket], bufs.positions[:bucket], caches, bufs.metadata(bucket))
    assert rel_err(out[:11], ref) < 1e-5
    for c, r in zip(caches, after_ref, strict=True):
        assert torch.equal(c, r)
    eng.shutdown()
