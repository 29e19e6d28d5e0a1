"""``TorchBackend``: attention in plain torch operators: the reference every other backend is
tested against, and what the generic path runs (CPU or CUDA; CUDA's default is Triton's).

Decodes gather their rows' blocks into one contiguous copy, put each row's new k/v at its
position in that copy, and attend with two batched matmuls and a float32 softmax: the same code
eagerly (the copy in reused scratch memory) and inside the compiled graph (a fresh copy, since
the graph must not write the cache). Prefill spans run one request at a time through SDPA, a
fresh prefill without touching the pool. Work is proportional to the tokens the step touches,
never to the size of the pool.

Why not SDPA for decodes: with one query per row, CPU's flash kernel spends its time on
per-tile setup; bmm reads the gathered K/V once, at memory speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend, Scratch, gather_blocks
from worker.attention.metadata import DecodeRows, PrefillSpan


class TorchBackend(AttentionBackend):
    """Gather, batched matmuls and softmax for decodes; SDPA for prefills."""

    name = "torch"

    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        rows: DecodeRows,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.decode``."""
        batch, n_heads, head_dim = q.shape
        n_kv, bs = layer.shape[1], self.block_size
        blocks = rows.blocks.view(-1)  # (B * M,)
        shape = (2, n_kv, blocks.numel(), bs, head_dim)
        out = None if scratch is None else scratch("decode_kv", shape)
        gathered = gather_blocks(layer, blocks, bs, out).view(2, n_kv, -1, head_dim)
        # Each row's own k/v at its position: an eager step wrote it into the cache already (the
        # same numbers again), a compiled one never writes the cache.
        gathered.index_copy_(2, rows.new_slot, kv.permute(1, 2, 0, 3))  # (2, n_kv, B * L, hd)
        keys, values = gathered.view(2, n_kv * batch, -1, head_dim)  # (n_kv * B, L, hd) each
        # Grouped-query trick: each KV head's group of query heads is that head's "query length",
        # so K/V are never repeated per query head.
        group = n_heads // n_kv
        qg = q.view(batch, n_kv, group, head_dim).transpose(0, 1).reshape(n_kv * batch, group, -1)
        scores = torch.baddbmm(rows.bias, qg, keys.transpose(1, 2), alpha=head_dim**-0.5)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (n_kv*B, g, L)
        out = torch.bmm(probs, values)  # (n_kv * B, group, hd)
        return out.view(n_kv, batch, group, head_dim).transpose(0, 1).reshape(batch, n_heads, -1)

    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """See ``AttentionBackend.prefill``."""
        qs = q[span.begin : span.end].transpose(0, 1)  # (n_heads, n, hd)
        if span.start == 0:
            ks = kv[span.begin : span.end, 0].transpose(0, 1)  # (n_kv, n, hd)
            vs = kv[span.begin : span.end, 1].transpose(0, 1)
        else:
            # (n_kv, M * bs, hd) each, widened from a narrower pool (float16 under float32)
            ks, vs = gather_blocks(layer, span.blocks, self.block_size).to(q.dtype)
        # 4-D with enable_gqa: CPU's flash kernel takes only 4-D inputs (3-D falls back to the
        # slower math kernel), and with 4-D it handles GQA without repeated K/V.
        if span.start == 0:
            out = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], is_causal=True, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], attn_mask=span.mask, enable_gqa=True
            )
        return out[0].transpose(0, 1)  # (n, n_heads, hd)
