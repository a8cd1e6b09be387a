"""kvfleet.engine.testing: tiny models are deterministic, cached, and come with a working tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.engine.testing import ARCHS, make_tiny_model
from kvfleet.engine.tokenizer import load_tokenizer


def test_same_arguments_same_weights_and_cached(tiny_model_factory, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    first = tiny_model_factory("qwen2")
    assert tiny_model_factory("qwen2") == first  # cached: same folder, not rebuilt
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model("qwen2", first.parent) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    again = make_tiny_model("qwen2", tmp_path)  # rebuilt from scratch elsewhere
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    other = make_tiny_model("qwen2", tmp_path, seed=1)
    assert other != again
    c = load_file(other / "model.safetensors")
    assert not (c["model.embed_tokens.weight"] == a["model.embed_tokens.weight"]).all()


@pytest.mark.parametrize("tiny_model_dir", ARCHS, indirect=True)
def test_tokenizer_and_config(tiny_model_dir: Path) -> None:
    import json

    tok = load_tokenizer(tiny_model_dir)
    text = "Once upon a time the king asked: what is the capital of France?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < len(tok) for i in ids)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tok) and config["num_key_value_heads"] < config["num_attention_heads"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model("gpt2", "/tmp/unused")
    with pytest.raises(ValueError, match="num_layers"):
        make_tiny_model("llama", "/tmp/unused", num_layers=0)


def test_default_model_is_found(smollm2_path: Path) -> None:
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.stat().st_size > 50e6


def test_hub_id_without_network_names_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfleet.engine.model_config import ModelConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: a hub id that is not cached must fail clearly
    with pytest.raises(ValueError, match="model: 'kvfleet-test/not-a-model' is no local folder"):
        ModelConfig.from_pretrained("kvfleet-test/not-a-model")
