"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral, Qwen2, Qwen3) over a paged KV cache.

Differences between the four are config switches: qkv bias (Qwen2), per-head q/k
RMSNorm before rope (Qwen3), tied embeddings, GQA. Parameter names follow the HF
checkpoints except the fused `qkv_proj` and `gate_up_proj` (see `load_weights`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvfleet.engine.attention import get_attention_backend
from kvfleet.engine.attention.metadata import AttentionMetadata
from kvfleet.engine.head_norm import QKNorm
from kvfleet.engine.model_config import ModelConfig
from kvfleet.engine.models.base import CausalLM
from kvfleet.engine.models.fp8 import Fp8Linear
from kvfleet.engine.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from kvfleet.engine.models.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from kvfleet.engine.rope import Rotary

# checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


# read once: "0" runs Qwen3's q/k norms as two RMSNorm calls before the attention op (the A/B baseline) instead of
# handing them to the op, whose Triton kernel normalises the heads where it rotates them
FUSED_QK_NORM = os.environ.get("KVFLEET_FUSED_QK_NORM", "1") != "0"


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_fn: Any) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        self.attention_fn = attention_fn

    def forward(self, hidden: torch.Tensor, rotary: Rotary,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)   # `hidden` may be a QuantizedActivation (FP8, fused quantization)
        tokens = qkv.shape[0]
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            if FUSED_QK_NORM:
                qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        # the attention op normalises (Qwen3) and rotates q and k: with its cache write one kernel on CUDA
        out = self.attention_fn(q, k, v, kv_cache, attn_metadata, self.scale, rotary=rotary, qk_norm=qk_norm)
        return self.o_proj(out.reshape(tokens, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias)
        self.quant_fp8 = False   # the activation kernel quantizes for an FP8 down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.quant_fp8))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_fn: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, attention_fn)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, its residual stream before that output is added).

        `residual` None: `hidden` is the stream itself (the first layer, or every layer when the adds
        are not deferred); otherwise the stream is hidden + residual, added by the input norm's fused
        kernel, as the next layer's (or the final norm's) adds this layer's output."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)  # fused on CUDA
        attn = self.self_attn(normed, rotary, kv_cache, attn_metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)  # fused on CUDA
        return self.mlp(normed), residual

    def fuse_fp8_activation_quant(self) -> int:
        """The kernels before qkv, gate_up and down quantize for them (models.fp8.FusesFp8ActivationQuant);
        only once those are FP8 layers."""
        consumers = (self.self_attn.qkv_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        if not all(isinstance(c, Fp8Linear) for c in consumers):
            raise ValueError("quantization: fused FP8 activation quantization needs FP8 qkv, gate_up and down "
                             "layers")
        self.input_layernorm.quant_fp8 = True
        self.post_attention_layernorm.quant_fp8 = True
        self.mlp.quant_fp8 = True
        return 3


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, attention_fn: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, attention_fn) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # read once: "0" adds each layer's MLP output to the stream by itself (one more kernel a layer,
        # the A/B baseline) instead of in the next norm's fused add
        self.defer_residual_add = os.environ.get("KVFLEET_FUSED_RESIDUAL", "1") != "0"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: {len(kv_caches)} tensors for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        rotary = Rotary(*self.rotary_emb(positions, hidden.dtype))
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rotary, kv_cache, attn_metadata)
            if not self.defer_residual_add:
                hidden, residual = hidden + residual, None
        out = self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)[0]
        if not isinstance(out, torch.Tensor):   # only norms read by an FP8 layer quantize; the LM head is not one
            raise TypeError("the final norm returned a quantized activation")
        return out


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, attention_fn: Any = None, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        attention_fn = attention_fn or get_attention_backend(device)
        self.attention_fn = attention_fn
        self.model = LlamaModel(cfg, attention_fn)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Flat tokens of the step -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model dtype."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named checkpoint tensors (or lazy slices) in; returns the checkpoint names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            hf_name, shard_id = name, None
            for fragment, (fused, sid) in _STACKED.items():
                if fragment in name:
                    name, shard_id = name.replace(fragment, fused), sid
                    break
            if name not in params:
                raise ValueError(f"weights: unexpected tensor {name!r} for {self.config.architecture}")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            loaded.add(hf_name)
        return loaded

    def expected_weights(self) -> set[str]:
        """Checkpoint (HF) tensor names a full checkpoint must provide: fused parameters need every part."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            parts = [name.replace(fused, frag) for frag, (fused, _) in _STACKED.items() if fused in name]
            names.update(parts or [name])
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
