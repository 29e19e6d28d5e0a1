"""The Llama family (Llama, SmolLM2, TinyLlama, Qwen2 with q/k/v bias, Qwen3 with q/k norm),
written in plain torch over a flattened batch of tokens and the paged ``KVCache``.

Module names mirror transformers' so a Hugging Face state dict loads as is. Classes run
bottom-up: norm, attention, MLP, decoder layer, model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionMetadata, paged_attention
from worker.kv_cache import KVCache
from worker.rope import apply_rotary, inverse_frequencies, rope_parameters, rotary_cos_sin


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family model, read from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        """Read the fields we need; Qwen2 has q/k/v bias but none on o_proj."""
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        qwen2 = config.model_type == "qwen2"
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=config.model_type == "qwen3",
            rope=rope_parameters(config),
        )


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like transformers."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings over the paged cache."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, hd = spec.hidden_size, spec.head_dim
        self.n_heads, self.n_kv, self.head_dim = spec.n_heads, spec.n_kv_heads, hd
        self.q_proj = nn.Linear(d, spec.n_heads * hd, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d, spec.n_kv_heads * hd, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d, spec.n_kv_heads * hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.n_heads * hd, d, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, torch.Tensor], meta):
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.n_heads, self.head_dim)  # (T, n_heads, hd)
        k = self.k_proj(x).view(tokens, self.n_kv, self.head_dim)  # (T, n_kv, hd)
        v = self.v_proj(x).view(tokens, self.n_kv, self.head_dim)  # (T, n_kv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, cache[0], cache[1], meta)  # (T, n_heads, hd)
        return self.o_proj(out.reshape(tokens, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d, h, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embedding, decoder layers and final norm (transformers' ``model.*`` names)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaModel(nn.Module):
    """The whole causal LM: ``forward`` gives hidden states, ``logits`` the vocabulary scores."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaBody(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", inverse_frequencies(spec.rope, spec.head_dim), persistent=False
        )

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict; tied models share the embedding as the lm head."""
        weights = dict(weights)
        if self.spec.tie_embeddings:
            weights.pop("lm_head.weight", None)
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        weights.pop("model.rotary_emb.inv_freq", None)
        self.load_state_dict(weights, strict=True, assign=True)
        if self.spec.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Built here, not trusted from __init__: the model may have been made on the meta device.
        device = self.model.embed_tokens.weight.device
        inv_freq = inverse_frequencies(self.spec.rope, self.spec.head_dim).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden), K/V written into ``cache``."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)  # (T, hd) each
        for index, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.layer(index), meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> float32 (S, vocab)."""
        return self.lm_head(hidden).float()
