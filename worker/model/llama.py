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
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.kv.cache import KVCache
from worker.linear.base import Linear
from worker.model.rope import apply_rotary, inverse_frequencies, rope_parameters, rotary_cos_sin
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
    """x / rms(x) * weight in one fused op. In float32 it equals transformers' formula bit for
    bit; in bfloat16 it rounds once at the end, where transformers rounds before the weight.

    With ``kernel`` set (the worker sets it where ``worker.cpu.kernels`` runs), eager bfloat16 steps
    take ``torch.ops.nanoserve.rms_norm``: the same formula in one pass, where eager torch runs
    six operators; with ``kernel_f32`` (``auto``'s float32, not the exact path), eager float32
    steps take ``torch.ops.nanoserve.rms_norm_f32`` (AVX2, sums in another order). Compiled
    graphs keep ``F.rms_norm``, which inductor fuses with its
    neighbours. Dynamo's own flag tells them apart: torch sets ``is_compiling()`` process-wide for
    a whole compile session, so while a background thread loads the graphs, the stepping
    thread's eager steps would read it too and leave the kernels."""

    kernel = False
    kernel_f32 = False

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.kernel
            and x.dtype == torch.bfloat16 == self.weight.dtype
            and x.dim() == 2
            and not torch.compiler.is_dynamo_compiling()
        ):
            return torch.ops.nanoserve.rms_norm(x, self.weight, self.eps)
        if (
            self.kernel_f32
            and x.dtype == torch.float32 == self.weight.dtype
            and x.dim() == 2
            and not torch.compiler.is_dynamo_compiling()
        ):
            return torch.ops.nanoserve.rms_norm_f32(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings over the paged cache.

    Loads as transformers' q/k/v_proj, then ``fuse`` concatenates them into one (q|k|v)
    matrix: one matmul instead of three, and one rotary call for q and k together. It holds
    the shard's heads only; o_proj's partial sums are all-reduced over the group. With
    ``kernel`` set, eager bfloat16 steps rotate with ``torch.ops.nanoserve.rotary_`` (one pass,
    torch's roundings; ``RMSNorm`` says when).
    """

    kernel = False

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

    def forward(self, x, cos, sin, attend: Attend):
        tokens, nq, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)  # (T, (nq + 2 * nkv) * hd)
        qkv = qkv.view(tokens, nq + 2 * nkv, self.head_dim)
        qk = qkv[:, : nq + nkv]  # (T, nq + nkv, hd)
        if hasattr(self, "q_norm"):
            qkv[:, :nq] = self.q_norm(qkv[:, :nq])
            qkv[:, nq : nq + nkv] = self.k_norm(qkv[:, nq : nq + nkv])
        # Rotated in place, so k and v stay side by side in qkv: one cache write for both.
        if self.kernel and qk.dtype == torch.bfloat16 and not torch.compiler.is_dynamo_compiling():
            torch.ops.nanoserve.rotary_(qk, cos, sin)
        else:
            apply_rotary(qk, cos, sin, out=qk)
        kv = qkv[:, nq:].view(tokens, 2, nkv, self.head_dim)
        out = attend(qkv[:, :nq], kv)  # (T, nq, hd)
        return self.group.all_reduce(self.o_proj(out.reshape(tokens, nq * self.head_dim)))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); ``fuse`` makes gate and up one matmul. It holds the
    shard's intermediate features; down_proj's partial sums are all-reduced over the group.
    With ``kernel`` set, eager bfloat16 steps take ``torch.ops.nanoserve.silu_mul`` (one pass,
    torch's roundings) for the activation (``RMSNorm`` says when); with ``kernel_f32``, eager
    float32 steps take ``torch.ops.nanoserve.silu_mul_f32`` (AVX2)."""

    kernel = False
    kernel_f32 = False

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * local intermediate)
        if (
            self.kernel
            and gate_up.dtype == torch.bfloat16
            and not torch.compiler.is_dynamo_compiling()
        ):
            return self.group.all_reduce(self.down_proj(torch.ops.nanoserve.silu_mul(gate_up)))
        if (
            self.kernel_f32
            and gate_up.dtype == torch.float32
            and not torch.compiler.is_dynamo_compiling()
        ):
            activation = torch.ops.nanoserve.silu_mul_f32(gate_up)
            return self.group.all_reduce(self.down_proj(activation))
        gate, up = gate_up.chunk(2, dim=-1)  # (T, local intermediate) each
        return self.group.all_reduce(self.down_proj(F.silu(gate, inplace=True).mul_(up)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, spec: ModelSpec, shard: Shard, group: Group) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, shard, group)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, shard, group)

    def forward(self, x, cos, sin, attend: Attend):
        # Residuals added in place into the fresh sublayer outputs (a + b == b + a exactly).
        x = self.self_attn(self.input_layernorm(x), cos, sin, attend).add_(x)
        return self.mlp(self.post_attention_layernorm(x)).add_(x)


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
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden states (T, hidden), K/V written into ``cache``."""
        x = self.embed(input_ids)  # (T, hidden)
        cos, sin = rotary_cos_sin(self.inv_freq, positions, x.dtype)  # (T, 1, hd) each
        attends = [
            partial(attention.forward, layer=cache.layer(index), meta=meta, scratch=cache.scratch)
            for index in range(self.spec.num_layers)
        ]
        return self.run_layers(x, cos, sin, attends)

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

    def run_layers(self, x, cos, sin, attends: list[Attend]) -> torch.Tensor:
        """Embedded tokens x (T, hidden) and their rotary cos/sin (T, 1, hd) -> final hidden
        states (T, hidden); layer i's attention is ``attends[i]``."""
        for layer, attend in zip(self.model.layers, attends, strict=True):
            x = layer(x, cos, sin, attend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> float32 (S, vocab), or (S, range) of the shard's vocabulary range
        (``Group.gather_vocab`` joins the ranges)."""
        return self.lm_head(hidden).float()
