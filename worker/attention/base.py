"""``AttentionBackend``: the operations every attention implementation provides.

A backend is chosen once, by the worker's plan (``worker.attention.make_backend``). The
model and the compiled decode step call it and never ask which one they have:

- ``metadata``: once per eager step, what every layer reads (``AttentionMetadata``);
- ``decode_rows``: once per compiled step, inside the traced graph, the decodes' part of it;
- ``forward``: one eager layer: write the new K/V into the paged cache, then attend (decodes
  and prefill spans together);
- ``decode``: one query per row over its cached positions plus its own new k/v, without writing
  the cache (the compiled graph writes every layer's K/V after it, in one copy);
- ``prefill``: one prefill span, fresh or continuing a cached prefix.

Shapes: q (T, n_heads, hd); kv (T, 2, n_kv, hd), each token's new K and V side by side; one
layer of the cache (2, n_kv, S, hd), S = (num_blocks + 1) * block_size, as ``KVCache.layer``.
q and kv are in the model's dtype (``dtype``); the cache may be narrower (``kv_dtype``: float16
under float32, on the CPU kernel's float32 path), and what is written to it is rounded to it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from worker.attention.metadata import AttentionMetadata, DecodeRows, PrefillSpan

# ``KVCache.scratch``: (name, shape) -> a reusable buffer in the pool's dtype.
Scratch = Callable[[str, tuple[int, ...]], torch.Tensor]


class AttentionBackend(ABC):
    """Paged attention for one model's heads over one cache's blocks."""

    name: str  # how the worker's log names it
    # The most rows of a group (a request's token and its draft tokens) its decode attends
    # causally within (``DecodeRows``); 0: none, such an item is a prefill span.
    group_rows: int = 0

    def __init__(
        self,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.kv_dtype = kv_dtype or dtype

    def metadata(
        self,
        items: list[tuple[list[int], int, int]],
        *,
        trash_block: int | None = None,
        device: str | None = None,
        groups: list[bool] | None = None,
    ) -> AttentionMetadata:
        """One step's metadata from ``(block_table, start, num_new)`` per item (see
        ``AttentionMetadata.build``), on ``device`` (default the backend's: the worker builds
        it on the host and sends it with the step's other inputs, ``worker.step.pack``).
        ``groups``: the items that are a token and its drafts, decode groups where this backend
        takes them (``group_rows``)."""
        return AttentionMetadata.build(
            items,
            block_size=self.block_size,
            n_kv_heads=self.n_kv_heads,
            dtype=self.dtype,
            device=device or self.device,
            trash_block=trash_block,
            groups=groups,
            group_rows=self.group_rows,
        )

    def decode_rows(
        self, blocks: torch.Tensor, cached: torch.Tensor, first: torch.Tensor | None = None
    ) -> DecodeRows:
        """A compiled step's decodes from its block ids (B, M), cached counts (B,) and groups'
        first rows (B,; None: each row alone)."""
        return DecodeRows.of(blocks, cached, self.block_size, self.n_kv_heads, self.dtype, first)

    def forward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        meta: AttentionMetadata,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """One eager layer: write kv (T, 2, n_kv, hd) into ``layer`` at ``meta.write_index``,
        then attend; q (T, n_heads, hd) -> (T, n_heads, hd). K and V travel together: one write
        per layer instead of two."""
        self.write(kv, layer, meta)
        if not meta.prefills:
            return self.decode(q, kv, layer, meta.decodes, scratch)
        lone = meta.prefills[0]
        if len(meta.prefills) == 1 and (lone.begin, lone.end) == (0, q.shape[0]):
            return self.prefill(q, kv, layer, lone)  # one prompt fills the step: no copy
        out = torch.zeros_like(q)  # zeros, not empty: padding rows must stay finite
        if meta.decode_tokens.numel():
            tokens, targets = meta.decode_tokens, meta.decode_targets
            decoded = self.decode(q[tokens], kv[tokens], layer, meta.decodes, scratch)
            out[targets] = decoded[: targets.numel()]
        for span in meta.prefills:
            out[span.begin : span.end] = self.prefill(q, kv, layer, span)
        return out

    def write(self, kv: torch.Tensor, layer: torch.Tensor, meta: AttentionMetadata) -> None:
        """Write the step's new kv (T, 2, n_kv, hd) into ``layer`` at ``meta.write_index``, in
        one indexed copy (padding tokens into the trash block)."""
        layer.index_copy_(2, meta.write_index, kv.permute(1, 2, 0, 3).to(layer.dtype))

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: torch.Tensor,
        rows: DecodeRows,
        scratch: Scratch | None = None,
    ) -> torch.Tensor:
        """q (B, n_heads, hd) and the rows' new kv (B, 2, n_kv, hd) -> (B, n_heads, hd): each
        row attends over its ``rows.cached`` positions in ``layer`` and then the new k/v of its
        group (``rows.first``; a backend without ``group_rows`` never gets a group), its own
        last.
        Reads ``layer`` only. ``scratch`` lends buffers where the call is not being traced."""

    @abstractmethod
    def prefill(
        self, q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, span: PrefillSpan
    ) -> torch.Tensor:
        """The span's queries q[begin:end] (n, n_heads, hd), causal over its cached prefix and
        its own new kv (already written into ``layer``) -> (n, n_heads, hd)."""


def gather_blocks(
    layer: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """layer (2, n_kv, S, hd), blocks (K,) -> K and V together, (2, n_kv, K * bs, hd): one
    contiguous copy per block, far fewer index computations than a per-token gather, into
    ``out`` (2, n_kv, K, bs, hd) if given."""
    two, n_kv, _, head_dim = layer.shape
    paged = layer.view(two, n_kv, -1, block_size, head_dim)  # (2, n_kv, N, bs, hd)
    if out is None:
        picked = paged.index_select(2, blocks)
    else:
        picked = torch.index_select(paged, 2, blocks, out=out)  # (2, n_kv, K, bs, hd)
    return picked.view(two, n_kv, -1, head_dim)
