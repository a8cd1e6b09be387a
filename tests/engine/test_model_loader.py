"""Weight loading: safetensors dtypes, dummy weights, bad checkpoints, and the real SmolLM2 GGUF."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.engine.attention import build_attention_metadata
from kvfleet.engine.gguf_loader import reverse_permute
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.model_loader import load_model


def _prefill_logits(model, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    block = 16
    blocks = -(-len(ids) // block)
    dtype = next(model.parameters()).dtype
    caches = [torch.zeros(2, blocks, block, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in range(cfg.num_layers)]
    md = build_attention_metadata([len(ids)], [len(ids)], [list(range(blocks))], block)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), caches, md))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dummy_weights_have_checkpoint_shapes(arch: str, tiny_model_factory, tmp_path: Path) -> None:
    import transformers

    folder = tiny_model_factory(arch)
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only / "config.json")  # a benchmark folder: no weights
    cfg = ModelConfig.from_pretrained(config_only)
    model = load_model(cfg, device="cpu", load_format="dummy")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref = {k: v.shape for k, v in hf.state_dict().items()}
    ours = dict(model.named_parameters())
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = sum(ref[p + f"self_attn.{x}_proj.weight"][0] for x in "qkv")
        assert ours[p + "self_attn.qkv_proj.weight"].shape == (qkv, cfg.hidden_size)
        assert ours[p + "mlp.gate_up_proj.weight"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
        assert ours[p + "mlp.down_proj.weight"].shape == ref[p + "mlp.down_proj.weight"]
        assert (p + "self_attn.qkv_proj.bias" in ours) == (arch == "qwen2")
    assert ours["model.embed_tokens.weight"].shape == ref["model.embed_tokens.weight"]
    assert all(torch.isfinite(p).all() for p in ours.values())
    assert 0.01 < float(ours["model.layers.0.mlp.down_proj.weight"].std()) < 0.03
    logits = _prefill_logits(model, cfg, [1, 2, 3, 4, 5])
    assert logits.shape == (5, cfg.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="model: no"):
        load_model(cfg, device="cpu")  # no weights and not dummy


def test_bfloat16_load_is_close_to_float32(tiny_model_factory) -> None:
    cfg = ModelConfig.from_pretrained(tiny_model_factory("qwen3"))
    ids = list(range(3, 40))
    ref = _prefill_logits(load_model(cfg, device="cpu"), cfg, ids)
    model = load_model(dataclasses.replace(cfg, dtype=torch.bfloat16), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    got = _prefill_logits(model, cfg, ids)
    assert got.dtype == torch.bfloat16   # logits in the model dtype: the sampler casts where it needs float32
    assert (got.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_bad_checkpoints_name_the_problem(tiny_model_factory, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tiny_model_factory("mistral")
    tensors = load_file(folder / "model.safetensors")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, broken / "model.safetensors")
    cfg = ModelConfig.from_pretrained(broken)
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_model(cfg, device="cpu")
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :5].contiguous()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_model(cfg, device="cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(cfg, device="cpu", load_format="pt")


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim/n_head/2, ...).swapaxes(1, 2)
    rng = np.random.default_rng(0)
    n_head, head_dim, hidden = 3, 8, 5
    w = rng.standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(reverse_permute(permuted, n_head), w)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):
    from kvfleet.engine.tokenizer import load_tokenizer

    cfg = ModelConfig.from_pretrained(smollm2_path)
    return cfg, load_model(cfg, device="cpu", quiet=True), load_tokenizer(smollm2_path)


def test_smollm2_gguf_matches_transformers_gguf_loading(smollm2, smollm2_path: Path) -> None:
    import transformers

    cfg, model, tok = smollm2
    shape = (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    assert shape == ("llama", 30, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = list(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    ids += tok.encode("The capital of France is", add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _prefill_logits(model, cfg, ids)
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))  # greedy next tokens identical at every position
    assert tok.decode([int(ours[-1].argmax())]).strip() == "Paris"
