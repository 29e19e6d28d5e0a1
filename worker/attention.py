"""Paged attention over the ``KVCache``.

``AttentionMetadata`` is built once per step from the rows' block tables and shared by every
layer. Decodes (one new token on top of a cached context) run together as one padded SDPA call;
prefills and prefill chunks run one request at a time, a fresh prefill without touching the pool.
Work is proportional to the tokens the step touches, never to the size of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    """Where each new token's K/V goes and what each query attends to."""

    write_index: torch.Tensor  # (T,) flat cache index of each new token
    decode_tokens: torch.Tensor  # (B,) batch positions of the decode tokens
    decode_blocks: torch.Tensor  # (B, M) block ids of each decode's row, padded
    decode_mask: torch.Tensor  # (B, 1, 1, M * block_size) bool, True on cached positions
    prefills: list[PrefillSpan]
    block_size: int

    @classmethod
    def build(
        cls, items: list[tuple[list[int], int, int]], block_size: int, device: str
    ) -> AttentionMetadata:
        """From ``(block_table, start, num_new)`` per item, in batch order."""
        write, decodes, prefills, offset = [], [], [], 0
        for table, start, n in items:
            write.append(_cache_index(table, start, start + n, block_size))
            if n == 1 and start > 0:
                decodes.append((offset, table, start + 1))
            else:
                prefills.append(_prefill_span(table, start, n, offset, block_size, device))
            offset += n
        d_tokens, d_blocks, d_mask = _decode_batch(decodes, block_size)
        return cls(
            write_index=torch.cat(write).to(device),
            decode_tokens=d_tokens.to(device),
            decode_blocks=d_blocks.to(device),
            decode_mask=d_mask.to(device),
            prefills=prefills,
            block_size=block_size,
        )


def _cache_index(table: list[int], begin: int, end: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(begin, end)
    blocks = torch.tensor(table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def _prefill_span(table, start, n, offset, block_size, device) -> PrefillSpan:
    if start == 0:
        return PrefillSpan(offset, offset + n, 0, None, None)
    used = -(-(start + n) // block_size)
    blocks = torch.tensor(table[:used], dtype=torch.long, device=device)
    queries = torch.arange(start, start + n)[:, None]  # (n, 1) absolute positions
    mask = (torch.arange(used * block_size)[None, :] <= queries).to(device)  # (n, M * bs)
    return PrefillSpan(offset, offset + n, start, blocks, mask)


def _decode_batch(decodes, block_size):
    if not decodes:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, 1, 1, dtype=bool)
    longest = max(-(-length // block_size) for _, _, length in decodes)
    blocks = torch.zeros(len(decodes), longest, dtype=torch.long)
    mask = torch.zeros(len(decodes), longest * block_size, dtype=torch.bool)
    for i, (_, table, length) in enumerate(decodes):
        used = -(-length // block_size)
        # Padding repeats the row's first block: any block in a table has been zeroed or
        # written, so it holds finite numbers (a NaN would survive its zero attention weight).
        blocks[i] = table[0]
        blocks[i, :used] = torch.tensor(table[:used])
        mask[i, :length] = True
    tokens = torch.tensor([offset for offset, _, _ in decodes], dtype=torch.long)
    return tokens, blocks, mask[:, None, None, :]


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache (N * bs, n_kv, hd), blocks (..., M) -> (..., M * bs, n_kv, hd), block by block
    (one contiguous copy per block, far faster than a per-token gather)."""
    paged = cache.view(-1, block_size, *cache.shape[1:])  # (N, bs, n_kv, hd)
    picked = paged.index_select(0, blocks.reshape(-1))  # (prod(...) * M, bs, n_kv, hd)
    return picked.view(*blocks.shape[:-1], blocks.shape[-1] * block_size, *cache.shape[1:])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write k, v (T, n_kv, hd) into the cache, then attend; q (T, n_heads, hd) -> same shape."""
    cache_k.index_copy_(0, meta.write_index, k)
    cache_v.index_copy_(0, meta.write_index, v)
    out = torch.empty_like(q)
    if meta.decode_tokens.numel():
        out[meta.decode_tokens] = _decode(q[meta.decode_tokens], cache_k, cache_v, meta)
    for span in meta.prefills:
        out[span.begin : span.end] = _prefill(q, k, v, cache_k, cache_v, span, meta.block_size)
    return out


def _decode(q, cache_k, cache_v, meta: AttentionMetadata) -> torch.Tensor:
    batch, n_heads, head_dim = q.shape
    n_kv = cache_k.shape[1]
    block_size = meta.block_size
    # Grouped-query trick: each KV head's group of query heads acts as its "query length", so
    # the gathered K/V are never copied per query head.
    qg = q.view(batch, n_kv, n_heads // n_kv, head_dim)  # (B, n_kv, group, hd)
    kg = _gather_blocks(cache_k, meta.decode_blocks, block_size).transpose(1, 2)  # (B, n_kv, L, hd)
    vg = _gather_blocks(cache_v, meta.decode_blocks, block_size).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=meta.decode_mask)
    return out.reshape(batch, n_heads, head_dim)


def _prefill(q, k, v, cache_k, cache_v, span: PrefillSpan, block_size: int) -> torch.Tensor:
    qs = q[span.begin : span.end].transpose(0, 1)  # (n_heads, n, hd)
    group = q.shape[1] // k.shape[1]
    if span.blocks is None:
        ks, vs = k[span.begin : span.end], v[span.begin : span.end]  # (n, n_kv, hd)
    else:
        ks = _gather_blocks(cache_k, span.blocks, block_size)  # (M * bs, n_kv, hd)
        vs = _gather_blocks(cache_v, span.blocks, block_size)
    # Repeat K/V per query head (as transformers' repeat_kv does): SDPA's enable_gqa would send
    # CPU to its slow math kernel instead of the flash one.
    ks = ks.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_heads, L, hd)
    vs = vs.repeat_interleave(group, dim=1).transpose(0, 1)
    if span.blocks is None:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask)
    return out.transpose(0, 1)  # (n, n_heads, hd)
