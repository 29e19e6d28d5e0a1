"""Paged attention over the ``KVCache``.

``AttentionMetadata`` is built once per step from the rows' block tables and shared by every
layer. Decodes (one new token on top of a cached context) run together as two batched matmuls
over their gathered blocks; prefills and prefill chunks run one request at a time through SDPA,
a fresh prefill without touching the pool. Work is proportional to the tokens the step touches,
never to the size of the pool.

Why not SDPA for decodes: with one query per row, CPU's flash kernel spends its time on
per-tile setup (0.9 ms a layer at batch 32); bmm reads the gathered K/V once, at memory speed.
A bfloat16 cache skips even the gather where nanoserve's own kernel builds
(``worker.kernels``): it reads each row's blocks in place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker import kernels
from worker.shapes import padded_count, padded_length


@dataclass(frozen=True)
class PrefillSpan:
    """One request's new tokens [begin, end) in the flattened batch, starting at ``start``."""

    begin: int
    end: int
    start: int
    blocks: torch.Tensor | None  # (M,) the row's block ids, None for a fresh prefill
    mask: torch.Tensor | None  # (n, M * block_size) bool, True where a query may attend


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to.

    Built with a ``trash_block``, the step is padded to bucketed sizes (``worker.shapes``):
    ``num_tokens`` counts the padding tokens after the real ones, which write their K/V into
    the trash block; decodes are padded with copies of the first decode, and every context
    length with masked positions. The real rows' numbers do not depend on the padding.
    """

    write_index: torch.Tensor  # (T,) flat cache index of each new token, padding included
    decode_tokens: torch.Tensor | None  # (B,) batch positions of the decodes; None: all T are
    decode_targets: torch.Tensor | None  # (B_real,) the real ones among them; None as above
    decode_blocks: torch.Tensor  # (B * M,) block ids of each decode's row, padded to M
    decode_lengths: torch.Tensor  # (B,) each decode's context length, its new token included
    decode_bias: torch.Tensor  # (n_kv * B, 1, M * block_size) 0 on cached positions, else -inf
    prefills: list[PrefillSpan]
    block_size: int
    num_tokens: int  # T: the real tokens, then the padding

    @classmethod
    def build(
        cls,
        items: list[tuple[list[int], int, int]],
        *,
        block_size: int,
        n_kv_heads: int,
        dtype: torch.dtype,
        device: str,
        trash_block: int | None = None,
    ) -> AttentionMetadata:
        """From ``(block_table, start, num_new)`` per item, in batch order; padded to bucketed
        sizes when given the cache's ``trash_block``."""
        write, decodes, prefills, offset = [], [], [], 0
        for table, start, n in items:
            positions = range(start, start + n)
            write.extend(table[p // block_size] * block_size + p % block_size for p in positions)
            if n == 1 and start > 0:
                decodes.append((offset, table, start + 1))
            else:
                prefills.append(_prefill_span(table, start, n, offset, block_size, device))
            offset += n
        num_tokens, real_decodes = offset, len(decodes)
        if trash_block is not None:
            num_tokens = padded_count(offset)
            trash = trash_block * block_size
            write.extend(trash + i % block_size for i in range(offset, num_tokens))
            decodes = _padded_decodes(decodes, offset, num_tokens, mixed=bool(prefills))
        blocks, lengths, bias = _decode_batch(
            decodes, block_size, n_kv_heads, dtype, trash_block is not None
        )
        tokens = targets = None
        if prefills:
            tokens = torch.tensor([d[0] for d in decodes], dtype=torch.long).to(device)
            targets = tokens[:real_decodes]
        return cls(
            write_index=torch.tensor(write, dtype=torch.long, device=device),
            decode_tokens=tokens,
            decode_targets=targets,
            decode_blocks=blocks.to(device),
            decode_lengths=lengths.to(device),
            decode_bias=bias.to(device),
            prefills=prefills,
            block_size=block_size,
            num_tokens=num_tokens,
        )


def _padded_decodes(decodes, offset: int, num_tokens: int, mixed: bool):
    """Copies of the first decode. In a decode-only step, one per padding token: a single
    batched attention covers all T rows. In a mixed step, enough to bucket the decode batch,
    all at the first decode's own position. Their outputs are never used."""
    if not decodes:
        return decodes
    if mixed:
        return decodes + [decodes[0]] * (padded_count(len(decodes)) - len(decodes))
    _, table, length = decodes[0]
    return decodes + [(i, table, length) for i in range(offset, num_tokens)]


def _prefill_span(table, start, n, offset, block_size, device) -> PrefillSpan:
    if start == 0:
        return PrefillSpan(offset, offset + n, 0, None, None)
    used = -(-(start + n) // block_size)
    blocks = torch.tensor(table[:used], dtype=torch.long, device=device)
    queries = torch.arange(start, start + n)[:, None]  # (n, 1) absolute positions
    mask = (torch.arange(used * block_size)[None, :] <= queries).to(device)  # (n, M * bs)
    return PrefillSpan(offset, offset + n, start, blocks, mask)


def _decode_batch(decodes, block_size, n_kv, dtype, bucketed: bool):
    """Padded block ids (B * M,), lengths (B,) and the additive mask (n_kv * B, 1,
    M * block_size)."""
    if not decodes:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0, 1, 0, dtype=dtype)
    longest = max(-(-length // block_size) for _, _, length in decodes)
    if bucketed:
        longest = -(-padded_length(longest * block_size) // block_size)
    # Padding repeats the row's first block: any block in a table has been zeroed or written,
    # so it holds finite numbers (a NaN would survive its zero attention weight).
    padded = [
        table[: -(-length // block_size)] + [table[0]] * (longest - -(-length // block_size))
        for _, table, length in decodes
    ]
    lengths = torch.tensor([length for _, _, length in decodes])  # (B,)
    keep = torch.arange(longest * block_size)[None, :] < lengths[:, None]  # (B, L)
    bias = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))
    bias = bias[None].expand(n_kv, -1, -1).reshape(n_kv * len(decodes), 1, -1)
    return torch.tensor(padded, dtype=torch.long).view(-1), lengths, bias


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out=None):
    """cache (2, n_kv, N * bs, hd), blocks (K,) -> K and V together, (2, n_kv, K * bs, hd):
    one contiguous copy per block, far faster than a per-token gather, into ``out`` if given."""
    two, n_kv, _, head_dim = cache.shape
    paged = cache.view(two, n_kv, -1, block_size, head_dim)  # (2, n_kv, N, bs, hd)
    if out is None:
        picked = paged.index_select(2, blocks)
    else:
        picked = torch.index_select(paged, 2, blocks, out=out)  # (2, n_kv, K, bs, hd)
    return picked.view(two, n_kv, -1, head_dim)


def paged_attention(q, kv, cache, meta: AttentionMetadata, scratch) -> torch.Tensor:
    """Write kv (T, 2, n_kv, hd) into one layer's cache (2, n_kv, N * bs, hd), then attend;
    q (T, n_heads, hd) -> same shape. ``scratch(name, shape)`` lends reusable buffers.
    K and V travel together: one write and one gather per layer instead of two each."""
    cache.index_copy_(2, meta.write_index, kv.permute(1, 2, 0, 3))
    if not meta.prefills:
        return _decode(q, cache, meta, scratch, kv)
    out = torch.zeros_like(q)  # zeros, not empty: padding rows must stay finite
    if meta.decode_tokens.numel():
        tokens = meta.decode_tokens
        decoded = _decode(q[tokens], cache, meta, scratch, kv[tokens])
        out[meta.decode_targets] = decoded[: meta.decode_targets.numel()]
    for span in meta.prefills:
        out[span.begin : span.end] = _prefill(q, kv, cache, span, meta.block_size)
    return out


@functools.cache
def uses_own_kernel(
    dtype: torch.dtype, device: torch.device, head_dim: int, n_heads: int, n_kv_heads: int
) -> bool:
    """Whether decodes over a pool of this dtype and device attend with
    ``torch.ops.nanoserve.decode_attention``: bfloat16 on CPU (it is a CPU operator), where it
    builds (``worker.kernels``) and takes these heads. The first call may build it."""
    if dtype != torch.bfloat16 or device.type != "cpu" or n_heads % n_kv_heads:
        return False
    group = n_heads // n_kv_heads
    return kernels.available() and torch.ops.nanoserve.decode_attention_supports(head_dim, group)


def _decode(q, cache, meta: AttentionMetadata, scratch, kv) -> torch.Tensor:
    """q (B, n_heads, hd) and the new kv (B, 2, n_kv, hd) of the step's decodes -> (B, n_heads,
    hd)."""
    batch, n_heads, head_dim = q.shape
    if uses_own_kernel(cache.dtype, cache.device, head_dim, n_heads, cache.shape[1]):
        # The new K/V are in the cache already; the kernel takes them from kv instead.
        blocks = meta.decode_blocks.view(batch, -1)  # (B, M)
        cached = meta.decode_lengths - 1  # (B,)
        return torch.ops.nanoserve.decode_attention(q, kv, cache, blocks, cached, meta.block_size)
    n_kv, bs = cache.shape[1], meta.block_size
    shape = (2, n_kv, meta.decode_blocks.numel(), bs, head_dim)
    length = shape[2] * bs // batch
    kv = _gather_blocks(cache, meta.decode_blocks, bs, scratch("decode_kv", shape))
    kv = kv.view(2, n_kv * batch, length, head_dim)  # (2, n_kv * B, L, hd), rows contiguous
    keys, values = kv[0], kv[1]
    # Grouped-query trick: each KV head's group of query heads is that head's "query length",
    # so K/V are never repeated per query head.
    group = n_heads // n_kv
    qg = q.view(batch, n_kv, group, head_dim).transpose(0, 1).reshape(n_kv * batch, group, -1)
    scores = torch.baddbmm(meta.decode_bias, qg, keys.transpose(1, 2), alpha=head_dim**-0.5)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (n_kv*B, g, L)
    out = torch.bmm(probs, values)  # (n_kv * B, group, hd)
    return out.view(n_kv, batch, group, head_dim).transpose(0, 1).reshape(batch, n_heads, -1)


def _prefill(q, kv, cache, span: PrefillSpan, block_size: int) -> torch.Tensor:
    qs = q[span.begin : span.end].transpose(0, 1)  # (n_heads, n, hd)
    if span.blocks is None:
        ks = kv[span.begin : span.end, 0].transpose(0, 1)  # (n_kv, n, hd)
        vs = kv[span.begin : span.end, 1].transpose(0, 1)
    else:
        ks, vs = _gather_blocks(cache, span.blocks, block_size)  # (n_kv, M * bs, hd) each
    # 4-D with enable_gqa: CPU's flash kernel takes only 4-D inputs (3-D falls back to the math
    # kernel, 2.6x slower at 192 tokens), and with 4-D it handles GQA without repeated K/V.
    if span.blocks is None:
        out = F.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], is_causal=True, enable_gqa=True
        )
    else:
        out = F.scaled_dot_product_attention(
            qs[None], ks[None], vs[None], attn_mask=span.mask, enable_gqa=True
        )
    return out[0].transpose(0, 1)  # (n, n_heads, hd)
