"""Our one-pass GGUF header reader, and the config and tokenizer built from it, against gguf-py's reader and
transformers' own GGUF loading: the real SmolLM2 file, and small files of each architecture we serve."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfleet.engine.gguf_config import config_dict, hf_config
from kvfleet.engine.gguf_file import read_gguf, tensor_data
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.tokenizer import load_tokenizer

TEXTS = ["Hello world", "  spaces\n\ttabs", "héllo ünïcode 日本語 🙂", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x**2", ""]


def test_header_matches_gguf_py_reader(smollm2_path: Path) -> None:
    import gguf

    ours = read_gguf(smollm2_path)
    reader = gguf.GGUFReader(str(smollm2_path))
    assert list(ours.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert len(ours.tensors) == len(reader.tensors) == 272
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert (mine.name, mine.shape, mine.ggml_type, mine.offset) == (
            theirs.name, tuple(reversed(theirs.shape.tolist())), int(theirs.tensor_type), theirs.data_offset)
        data = tensor_data(ours, mine)
        assert data.shape == theirs.data.shape and data.dtype == theirs.data.dtype
        assert np.array_equal(data, theirs.data), mine.name


def test_config_and_tokenizer_match_transformers_on_smollm2(smollm2_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(smollm2_path.parent), smollm2_path.name
    contents = read_gguf(smollm2_path)
    assert config_dict(contents) == load_gguf_checkpoint(str(smollm2_path), return_tensors=False)["config"]
    assert hf_config(contents, folder).to_dict() == AutoConfig.from_pretrained(
        folder, gguf_file=name, local_files_only=True).to_dict()
    _assert_same_tokenizer(load_tokenizer(smollm2_path),
                           AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True))


def _assert_same_tokenizer(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    assert ours.chat_template == theirs.chat_template


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    """A small GPT-2-style byte-level BPE vocabulary: the 256 byte symbols, a few merges, and specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "o r", "Ġ w", "Ġw or", "Ġwor l", "Ġworl d"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, merges


def _write_gguf(path: Path, arch: str, *, name: str = "tiny", tied: bool = True) -> None:
    import gguf

    tokens, merges = _byte_level_vocab()
    hidden, vocab = 64, len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(2048)
    w.add_block_count(2)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "smaug-bpe")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (vocab - 3) + [3] * 3)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", rng.standard_normal((vocab, hidden), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("arch", "name", "tied"), [
    ("llama", "tiny", True), ("llama", "mistral", False), ("qwen2", "tiny", False), ("qwen3", "tiny", True)])
def test_each_served_architecture_matches_transformers(tmp_path: Path, arch: str, name: str, tied: bool) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "model.gguf"
    _write_gguf(path, arch, name=name, tied=tied)
    contents = read_gguf(path)
    expected = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert config_dict(contents) == expected
    assert expected["tie_word_embeddings"] is tied
    assert expected["model_type"] == ("mistral" if name == "mistral" else arch)
    assert hf_config(contents, str(tmp_path)).to_dict() == AutoConfig.from_pretrained(
        str(tmp_path), gguf_file=path.name, local_files_only=True).to_dict()
    _assert_same_tokenizer(load_tokenizer(path),
                           AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True))


def test_an_architecture_we_do_not_serve_is_left_to_transformers(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _write_gguf(path, "gpt2")
    assert config_dict(read_gguf(path)) is None
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        ModelConfig.from_pretrained(path)


def test_a_file_replaced_in_place_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _write_gguf(path, "llama")
    assert read_gguf(path).architecture == "llama"
    _write_gguf(path, "qwen2", tied=False)
    os.utime(path, ns=(1, 1))   # a different mtime even on a coarse clock
    assert read_gguf(path).architecture == "qwen2"


def test_bad_files_get_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _write_gguf(path, "llama")
    whole = path.read_bytes()
    path.write_bytes(whole[:4000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(path)
    path.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    path.write_bytes(whole[:4] + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="GGUF v9"):
        read_gguf(path)
    for short in (b"", b"GGUF"):
        path.write_bytes(short)
        with pytest.raises(ValueError, match=f"not a GGUF file \\({len(short)} bytes\\)"):
            read_gguf(path)
