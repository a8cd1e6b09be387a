"""Tiny random-weight models + a hub-free tokenizer, saved as normal HF folders.

Used by the tests, the demo and the benchmarks:

    path = make_tiny_model("qwen3", "/tmp/models")   # -> /tmp/models/tiny-qwen3-<hash>/

Everything is deterministic (fixed seeds, fixed training text) and built once per
folder: a second call with the same arguments returns the existing folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from kvfleet.engine.core.grammar import TokenGrammar

logger = logging.getLogger(__name__)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a an of to in is was on for with as by at from that this it he she they we you i "
    "once upon time there lived king queen city river mountain forest small big old new "
    "red blue green cat dog bird fish tree house road ship star moon sun day night water fire "
    "what where when who why how capital france paris london berlin rome tokyo answer question "
    "model token engine block cache batch request prompt hello world good bad yes no one two three"
).split()
_BUILD_VERSION = 1  # bump when the build recipe changes so cached folders are rebuilt


def _training_text(lines: int = 400) -> list[str]:
    """Deterministic pseudo-sentences (a linear congruential generator, no global RNG state)."""
    state, out = 12345, []
    for _ in range(lines):
        words = []
        for _ in range(6 + state % 9):
            state = (state * 1103515245 + 12345) % 2**31
            words.append(_WORDS[state % len(_WORDS)])
        sentence = " ".join(words).capitalize() + ("?" if state % 5 == 0 else ".")
        out.append(sentence + f" {state % 1000}")
    return out


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on the text above -> transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    arch: str, vocab_size: int, num_layers: int = 2, max_position_embeddings: int = 1024, num_kv_heads: int = 2
) -> Any:
    """The transformers config of a tiny model: hidden 64, 4 query / 2 KV heads (by default) of 16 dims."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":  # Llama-3 rope scaling, untied head
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2":  # qkv bias, tied head
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k norm, tied head
        return transformers.Qwen3Config(**common, tie_word_embeddings=True)
    raise ValueError(f"arch: {arch!r} is not one of {', '.join(ARCHS)}")


def _randomize(model: Any, seed: int, std: float) -> None:
    """Every parameter random (norm weights around 1, biases small) so loading mistakes show up."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)


def make_tiny_model(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_layers: int = 2,
    vocab_size: int = 512,
    std: float = 0.1,
    max_position_embeddings: int = 1024,
    num_kv_heads: int = 2,
    added_tokens: tuple[str, ...] = (),
    special_tokens: tuple[str, ...] = (),
) -> Path:
    """Build (once) and save a tiny `arch` model with tokenizer under `path`; returns its folder. `added_tokens`:
    single tokens added to the tokenizer, not special (kept in decoded text, as a reasoning model's <think>);
    `special_tokens`: single special tokens (gone from text decoded with skip_special_tokens, as Mistral's
    [TOOL_CALLS])."""
    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not one of {', '.join(ARCHS)}")
    if num_layers < 1:
        raise ValueError(f"num_layers: {num_layers} must be >= 1")
    if num_kv_heads not in (1, 2, 4):
        raise ValueError(f"num_kv_heads: {num_kv_heads} must divide the 4 query heads")
    spec = dict(arch=arch, seed=seed, num_layers=num_layers, vocab_size=vocab_size, std=std,
                max_position_embeddings=max_position_embeddings, version=_BUILD_VERSION)
    if num_kv_heads != 2:  # keep the folder names of existing default builds
        spec["num_kv_heads"] = num_kv_heads
    if added_tokens:
        spec["added_tokens"] = list(added_tokens)
    if special_tokens:
        spec["special_tokens"] = list(special_tokens)
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(path) / f"tiny-{arch}-{digest}"
    marker = folder / "kvfleet-tiny.json"
    if marker.is_file():
        return folder
    import torch
    import transformers

    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_tokens(list(added_tokens))
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    config = tiny_config(arch, len(tokenizer), num_layers, max_position_embeddings, num_kv_heads)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, std)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # quiet test logs
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (tmp / "kvfleet-tiny.json").write_text(json.dumps(spec, indent=1))
    try:
        tmp.rename(folder)  # atomic: concurrent builders never see half a folder
    except OSError:
        if not marker.is_file():
            raise
    logger.info("built tiny %s model at %s", arch, folder)
    return folder


def hf_greedy_tokens(model: Any, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """A transformers model's greedy continuation of each prompt, exactly `max_new` tokens (EOS ignored), one prompt
    at a time on the model's device: the reference the engine's greedy tokens are held to."""
    import torch

    model.generation_config.eos_token_id = None
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=device)
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
            out.append(seq[0, len(prompt):].tolist())
    return out


def hf_constrained_greedy_tokens(model: Any, grammar: TokenGrammar, prompt: Sequence[int], max_new: int,
                                 stop_ids: Collection[int]) -> list[int]:
    """A transformers model's greedy continuation under a structured-output constraint (the reference for the
    engine's): at each step its logits with the tokens the constraint does not allow at -inf (bits unpacked with
    numpy, apart from the engine's sampler), argmax, the constraint advanced; until a stop id, a complete output
    or `max_new` tokens. One full forward per token: small models only."""
    import numpy as np
    import torch

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids, out = list(prompt), []
    mask = np.zeros((1, grammar.bitmask_words()), dtype=np.int32)
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
            grammar.fill_bitmask(mask, 0)
            allowed = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
            banned = torch.from_numpy(~allowed).to(device)
            token = int(logits.masked_fill(banned, float("-inf")).argmax())
            out.append(token)
            ids.append(token)
            if not grammar.accept(token):
                raise AssertionError(f"the constraint refused its own allowed token {token}")
            if token in stop_ids or grammar.is_terminated():
                break
    return out
