"""The Llama family (Llama, SmolLM2, TinyLlama, Qwen2 with q/k/v bias, Qwen3 with q/k norm),
written in plain torch over a flattened batch of tokens and the paged ``KVCache``.

Module names mirror transformers' so a Hugging Face state dict loads as is. Classes run
bottom-up: norm, attention, MLP, decoder layer, model.

Under tensor parallelism each rank builds the model of its ``Shard`` (whole heads, a slice of
the MLP and of the vocabulary; see ``worker.parallel.sharding``) and calls its ``Group`` where the
partial results meet: after o_proj and down_proj (all-reduce) and after the embedding. The
group of one (``SOLO``) makes each such call the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.kv.cache import KVCache
from worker.linear.base import Linear
from worker.model.ops import EAGER_TORCH, ModelOps
from worker.model.rope import inverse_frequencies, rope_parameters, rotary_cos_sin
from worker.parallel.group import SOLO, Group
from worker.parallel.sharding import Shard

# One layer's attention: q (T, n_heads, hd) and the new k/v (T, 2, n_kv, hd) -> (T, n_heads, hd).
# The model does not care where K/V live: eager steps write them into the paged cache and attend
# (``AttentionBackend.forward``), compiled decode steps attend over a read-only view of it
# (``AttentionBackend.decode``, from ``worker.compiled.decode``).
Attend = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    """RMSNorm's weight; the norm itself is the plan's (``ModelOps.rms_norm``). Qwen3's q/k
    norms (3-D inputs) always take torch's."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: ModelOps = EAGER_TORCH) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings over the paged cache.

    Loads as transformers' q/k/v_proj, then ``fuse`` concatenates them into one (q|k|v)
    matrix: one matmul instead of three, and one rotary call for q and k together. It holds
    the shard's heads only; o_proj's partial sums are all-reduced over the group. q and k are
    rotated with the plan's ``ModelOps.rotary_``.
    """

    def __init__(self, spec: ModelSpec, shard: Shard, group: Group) -> None:
        super().__init__()
        d, hd = spec.hidden_size, spec.head_dim
        nq, nkv = shard.local_heads, shard.local_kv_heads
        self.n_heads, self.n_kv, self.head_dim, self.group = nq, nkv, hd, group
        self.q_proj = Linear(d, nq * hd, bias=spec.qkv_bias)
        self.k_proj = Linear(d, nkv * hd, bias=spec.qkv_bias)
        self.v_proj = Linear(d, nkv * hd, bias=spec.qkv_bias)
        self.o_proj = Linear(nq * hd, d, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(hd, spec.rms_norm_eps)

    def fuse(self) -> None:
        """Replace q/k/v_proj by one (q|k|v) weight (and bias)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        self.qkv_proj = Linear.of(torch.cat([p.weight for p in parts]), bias)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, cos, sin, attend: Attend, ops: ModelOps):
        tokens, nq, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)  # (T, (nq + 2 * nkv) * hd)
        qkv = qkv.view(tokens, nq + 2 * nkv, self.head_dim)
        qk = qkv[:, : nq + nkv]  # (T, nq + nkv, hd)
        if hasattr(self, "q_norm"):
            qkv[:, :nq] = self.q_norm(qkv[:, :nq])
            qkv[:, nq : nq + nkv] = self.k_norm(qkv[:, nq : nq + nkv])
        ops.rotary_(qk, cos, sin)  # in place: k and v stay side by side, one cache write
        kv = qkv[:, nq:].view(tokens, 2, nkv, self.head_dim)
        out = attend(qkv[:, :nq], kv)  # (T, nq, hd)
        return self.group.all_reduce(self.o_proj(out.reshape(tokens, nq * self.head_dim)))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), the activation the plan's
    (``ModelOps.silu_mul``); ``fuse`` makes gate and up one matmul. It holds the shard's
    intermediate features; down_proj's partial sums are all-reduced over the group."""

    def __init__(self, spec: ModelSpec, shard: Shard, group: Group) -> None:
        super().__init__()
        d, h, bias = spec.hidden_size, shard.local_intermediate, spec.mlp_bias
        self.group = group
        self.gate_proj = Linear(d, h, bias=bias)
        self.up_proj = Linear(d, h, bias=bias)
        self.down_proj = Linear(h, d, bias=bias)

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one (gate|up) weight (and bias)."""
        gate, up = self.gate_proj, self.up_proj
        bias = None if gate.bias is None else torch.cat((gate.bias, up.bias))
        self.gate_up_proj = Linear.of(torch.cat((gate.weight, up.weight)), bias)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * local intermediate)
        return self.group.all_reduce(self.down_proj(ops.silu_mul(gate_up)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, spec: ModelSpec, shard: Shard, group: Group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, shard, group)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, shard, group)

    def forward(self, x, cos, sin, attend: Attend, ops: ModelOps):
        # Residuals added in place into the fresh sublayer outputs (a + b == b + a exactly).
        x = self.self_attn(self.input_layernorm(x, ops), cos, sin, attend, ops).add_(x)
        return self.mlp(self.post_attention_layernorm(x, ops), ops).add_(x)


class LlamaBody(nn.Module):
    """Embedding (the shard's vocabulary range), decoder layers and final norm (transformers'
    ``model.*`` names)."""

    def __init__(self, spec: ModelSpec, shard: Shard, group: Group) -> None:
        super().__init__()
        start, end = shard.vocab_range
        self.embed_tokens = nn.Embedding(end - start, spec.hidden_size)
        layers = (DecoderLayer(spec, shard, group) for _ in range(spec.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaModel(nn.Module):
    """The whole causal LM: ``forward`` gives hidden states, ``logits`` the vocabulary scores
    (of the shard's vocabulary range)."""

    def __init__(self, spec: ModelSpec, shard: Shard | None = None, group: Group = SOLO) -> None:
        super().__init__()
        self.spec = spec
        self.shard = shard or Shard.of(spec)
        self.group = group
        self.model = LlamaBody(spec, self.shard, group)
        start, end = self.shard.vocab_range
        self.lm_head = Linear(spec.hidden_size, end - start, bias=False)
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
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
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
        attention: AttentionBackend,
        ops: ModelOps = EAGER_TORCH,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden), K/V written into ``cache``;
        the pointwise ops are ``ops`` (the plan's)."""
        x = self.embed(input_ids)  # (T, hidden)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)  # (T, 1, hd) each
        attends = [
            partial(attention.forward, layer=cache.layer(index), meta=meta, scratch=cache.scratch)
            for index in range(self.spec.num_layers)
        ]
        return self.run_layers(x, cos, sin, attends, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> embeddings (T, hidden). Split by vocabulary, each rank embeds the
        tokens of its range and zeros the others; the all-reduce sums one row and zeros, which
        is exact."""
        if self.group.size == 1:
            return self.model.embed_tokens(input_ids)
        start, end = self.shard.vocab_range
        local = input_ids - start
        outside = (local < 0) | (local >= end - start)  # (T,)
        x = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    def run_layers(self, x, cos, sin, attends: list[Attend], ops: ModelOps) -> torch.Tensor:
        """Embedded tokens x (T, hidden) and their rotary cos/sin (T, 1, hd) -> final hidden
        states (T, hidden); layer i's attention is ``attends[i]``."""
        for layer, attend in zip(self.model.layers, attends, strict=True):
            x = layer(x, cos, sin, attend, ops)
        return self.model.norm(x, ops)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> float32 (S, vocab), or (S, range) of the shard's vocabulary range
        (``Group.gather_vocab`` joins the ranges)."""
        return self.lm_head(hidden).float()
