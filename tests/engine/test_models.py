"""Our forward over the paged KV cache against transformers' forward on the same weights (float32).

Tolerance: logits within 1e-4 absolute (they are O(1); measured differences are ~1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.attention import build_attention_metadata
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_loader import load_model

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ATOL = 1e-4
BLOCK = 16


def hf_logits(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in sequences]


class PagedRunner:
    """Drives the model step by step like an engine would: shuffled blocks, sequences laid end to end."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int = 64) -> None:
        self.model, self.cfg = model, cfg
        self.caches = [torch.zeros(2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """work: (seq id, its full token list, of which the next n tokens are computed). -> logits per item."""
        ids, positions, q_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in work:
            start = self.done.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK < len(tokens):
                table.append(self.free.pop())
            ids += tokens[start:]
            positions += range(start, len(tokens))
            q_lens.append(len(tokens) - start)
            seq_lens.append(len(tokens))
            tables.append(table)
            self.done[seq] = len(tokens)
        md = build_attention_metadata(q_lens, seq_lens, tables, BLOCK)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions), self.caches, md))
        out, offset = [], 0
        for n in q_lens:
            out.append(logits[offset : offset + n])
            offset += n
        return out


def _sequences(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest, tiny_model_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            folder = tiny_model_factory(arch)
            cfg = ModelConfig.from_pretrained(folder)
            seqs = _sequences(cfg.vocab_size)
            cache[arch] = (cfg, load_model(cfg, device="cpu"), seqs, hf_logits(folder, seqs))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_matches_transformers(arch: str, loaded) -> None:
    cfg, model, seqs, refs = loaded(arch)
    runner = PagedRunner(model, cfg)
    outs = runner.step([(i, s) for i, s in enumerate(seqs)])
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_residual_adds_on_their_own_match_transformers(arch: str, loaded) -> None:
    """KVFLEET_FUSED_RESIDUAL=0's path: each layer adds its MLP output to the stream itself."""
    cfg, model, seqs, refs = loaded(arch)
    assert model.model.defer_residual_add   # the default: the next norm's fused add does it
    model.model.defer_residual_add = False
    try:
        outs = PagedRunner(model, cfg).step([(i, s) for i, s in enumerate(seqs)])
    finally:
        model.model.defer_residual_add = True
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_transformers(arch: str, loaded) -> None:
    """Prompts in chunks of 7 mixed with decode steps of other sequences in the same step."""
    cfg, model, seqs, refs = loaded(arch)
    runner = PagedRunner(model, cfg)
    prompt_len = {0: 3, 1: 9, 2: 20}  # prefill this much in chunks, then decode one token per step
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    progress = {i: 0 for i in range(len(seqs))}
    while any(progress[i] < len(seqs[i]) for i in progress):
        work = []
        for i, seq in enumerate(seqs):
            if progress[i] >= len(seq):
                continue
            n = min(7, prompt_len[i] - progress[i]) if progress[i] < prompt_len[i] else 1
            progress[i] += n
            work.append((i, seq[: progress[i]]))
        for (i, _), out in zip(work, runner.step(work), strict=True):
            got[i].append(out)
    for i, ref in enumerate(refs):
        ours = torch.cat(got[i])
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
        # greedy choices agree wherever transformers' top two are not a near tie
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_config_fields(tiny_model_factory) -> None:
    llama = ModelConfig.from_pretrained(tiny_model_factory("llama"))
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.num_layers) == (4, 2, 16, 2)
    assert llama.rope_scaling and llama.rope_scaling["rope_type"] == "llama3"
    assert not llama.tie_word_embeddings and llama.eos_token_ids == [2]
    qwen2 = ModelConfig.from_pretrained(tiny_model_factory("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    assert ModelConfig.from_pretrained(tiny_model_factory("qwen3")).qk_norm
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig.from_pretrained(tiny_model_factory("llama"), max_model_len=10**6)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_pretrained(tiny_model_factory("llama"), dtype="int3")
    with pytest.raises(ValueError, match="model"):
        ModelConfig.from_pretrained("/nonexistent/model")
