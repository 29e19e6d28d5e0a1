"""What every layer's attention reads in one step, built once per step.

``AttentionMetadata`` comes from the rows' block tables: where each new token's K/V goes, which
tokens are decodes (one new token on top of a cached context) and which are prefill spans.
``DecodeRows`` is the decodes' part, the only part a compiled step has: it is built the same way
from the metadata's tensors and from the traced graph's inputs.

Built with the cache's trash block, a step is padded to bucketed sizes (``worker.shapes``): the
padding tokens write their K/V into the trash block; decodes are padded with copies of the first
decode, and every context length with masked positions. The real rows' numbers do not depend on
the padding.

``PrefillBatch`` is every prefill span of a step in one int32 table, for a backend whose kernel
takes them all in one launch (``worker.attention.triton_backend``); only such a backend asks
for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from protocol.blocks import blocks_for
from worker.shapes import padded_count, padded_length


class DecodeRows(NamedTuple):
    """The step's decodes: one query per row over the row's cached positions and its new k/v.

    A group of rows (a request's token and its draft tokens, at consecutive positions over one
    cached context) attends causally within itself: row r attends over its cached positions,
    then the new k/v of rows ``first[r]`` to r. Only a backend with ``group_rows`` builds
    groups; elsewhere ``first[r]`` is r."""

    blocks: torch.Tensor  # (B, M) int64 each row's block ids, padded to M blocks
    cached: torch.Tensor  # (B,) int64 positions each row has cached, its new token not included
    bias: torch.Tensor  # (n_kv * B, 1, M * bs) 0 up to the new token's position, -inf beyond
    new_slot: torch.Tensor  # (B,) int64 where each row's new token sits in a (B * M * bs) gather
    first: torch.Tensor  # (B,) int64 the first row of each row's group

    @classmethod
    def of(
        cls,
        blocks: torch.Tensor,
        cached: torch.Tensor,
        block_size: int,
        n_kv_heads: int,
        dtype: torch.dtype,
        first: torch.Tensor | None = None,
    ) -> DecodeRows:
        """From the padded block ids (B, M), cached counts (B,) and groups' first rows (B,;
        None: every row alone); plain tensor code, so a compiled graph builds its own from its
        inputs."""
        batch, width = blocks.shape[0], blocks.shape[1] * block_size
        positions = torch.arange(width, device=blocks.device)  # (L,)
        past = positions[None, :] > cached[:, None]  # (B, L)
        bias = torch.zeros(past.shape, dtype=dtype, device=blocks.device)
        bias = bias.masked_fill_(past, float("-inf"))[None].expand(n_kv_heads, -1, -1)
        rows = torch.arange(batch, device=blocks.device)
        new_slot = rows * width + cached
        first = rows if first is None else first
        return cls(blocks, cached, bias.reshape(n_kv_heads * batch, 1, width), new_slot, first)

    def to(self, device: str) -> DecodeRows:
        """The same rows on ``device``."""
        return DecodeRows(*(tensor.to(device) for tensor in self))


@dataclass(frozen=True)
class PrefillSpan:
    """One request's new tokens [begin, end) in the flattened batch, starting at ``start``."""

    begin: int
    end: int
    start: int
    blocks: torch.Tensor  # (M,) the row's block ids for positions [0, start + n)
    mask: torch.Tensor | None  # (n, M * block_size) bool, True where a query may attend; None
    # for a fresh prefill (start 0: plainly causal)


class PrefillBatch(NamedTuple):
    """Every prefill span of a step, one row each of ``table`` (P, 3 + M) int32: the span's
    first batch position (``begin``), its new tokens (``length``), the positions it has cached
    (``start``), then the block ids of positions [0, start + length), padded to M with the row's
    first block. ``longest`` and ``tokens`` are known on the host: a kernel's grid and whether
    the spans and decodes cover the whole step need no read of a device tensor."""

    table: torch.Tensor
    longest: int  # the longest span's new tokens
    tokens: int  # every span's new tokens together

    @classmethod
    def of(cls, spans: list[tuple[list[int], int, int, int]], block_size: int, device: str):
        """From ``(block_table, start, num_new, begin)`` per span."""
        used = [blocks_for(start + n, block_size) for _, start, n, _ in spans]
        width = max(used)
        rows = [
            [begin, n, start, *table[:u], *[table[0]] * (width - u)]
            for (table, start, n, begin), u in zip(spans, used, strict=True)
        ]
        table = torch.tensor(rows, dtype=torch.int32).to(device)  # one copy to the device
        return cls(table, max(n for _, _, n, _ in spans), sum(n for _, _, n, _ in spans))


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to."""

    write_index: torch.Tensor  # (T,) flat cache index of each new token, padding included
    decode_tokens: torch.Tensor | None  # (B,) batch positions of the decodes; None: all T are
    decode_targets: torch.Tensor | None  # (B_real,) the real ones among them; None as above
    decodes: DecodeRows
    prefills: list[PrefillSpan]
    num_tokens: int  # T: the real tokens, then the padding
    prefill_batch: PrefillBatch | None = None  # the spans in one table, where the backend asks

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
        batch_prefills: bool = False,
        groups: list[bool] | None = None,
        group_rows: int = 0,
    ) -> AttentionMetadata:
        """From ``(block_table, start, num_new)`` per item, in batch order; padded to bucketed
        sizes when given the cache's ``trash_block``; with ``batch_prefills``, the prefill spans
        in one ``PrefillBatch`` too. An item that ``groups`` marks (a token and its drafts) of
        at most ``group_rows`` tokens over a cached context is a group of decode rows
        (``DecodeRows``), not a prefill span."""
        write, decodes, prefills, spans, offset = [], [], [], [], 0
        for index, (table, start, n) in enumerate(items):
            positions = range(start, start + n)
            write.extend(table[p // block_size] * block_size + p % block_size for p in positions)
            grouped = groups is not None and groups[index] and 1 < n <= group_rows
            if (n == 1 or grouped) and start > 0:
                # (batch position, table, cached, the group's first row in ``decodes``)
                head = len(decodes)
                decodes.extend((offset + j, table, start, head) for j in range(n))
            else:
                prefills.append(_prefill_span(table, start, n, offset, block_size, device))
                spans.append((table, start, n, offset))
            offset += n
        num_tokens, real_decodes = offset, len(decodes)
        if trash_block is not None:
            num_tokens = padded_count(offset)
            trash = trash_block * block_size
            write.extend(trash + i % block_size for i in range(offset, num_tokens))
            decodes = _padded_decodes(decodes, offset, num_tokens, mixed=bool(prefills))
        blocks, cached = _decode_tables(decodes, block_size, bucketed=trash_block is not None)
        first = torch.tensor([d[3] for d in decodes], dtype=torch.long)  # (B,)
        rows = DecodeRows.of(blocks, cached, block_size, n_kv_heads, dtype, first)
        tokens = targets = None
        batch = batch_prefills and bool(spans)
        if prefills:
            tokens = torch.tensor([d[0] for d in decodes], dtype=torch.long).to(device)
            targets = tokens[:real_decodes]
        return cls(
            write_index=torch.tensor(write, dtype=torch.long, device=device),
            decode_tokens=tokens,
            decode_targets=targets,
            decodes=rows.to(device),
            prefills=prefills,
            num_tokens=num_tokens,
            prefill_batch=PrefillBatch.of(spans, block_size, device) if batch else None,
        )


def _padded_decodes(decodes, offset: int, num_tokens: int, mixed: bool):
    """Copies of the first decode, each a group of its own. In a decode-only step, one per
    padding token: a single batched attention covers all T rows. In a mixed step, enough to
    bucket the decode batch, all at the first decode's own position. Their outputs are never
    used."""
    if not decodes:
        return decodes
    at, table, cached, _ = decodes[0]
    if mixed:
        count = padded_count(len(decodes))
        return decodes + [(at, table, cached, row) for row in range(len(decodes), count)]
    return decodes + [(i, table, cached, i) for i in range(offset, num_tokens)]


def _prefill_span(table, start, n, offset, block_size, device) -> PrefillSpan:
    used = blocks_for(start + n, block_size)
    blocks = torch.tensor(table[:used], dtype=torch.long, device=device)
    if start == 0:
        return PrefillSpan(offset, offset + n, 0, blocks, None)
    queries = torch.arange(start, start + n)[:, None]  # (n, 1) absolute positions
    mask = (torch.arange(used * block_size)[None, :] <= queries).to(device)  # (n, M * bs)
    return PrefillSpan(offset, offset + n, start, blocks, mask)


def _decode_tables(decodes, block_size: int, bucketed: bool):
    """Padded block ids (B, M) and cached counts (B,) of ``(offset, table, cached, first)``
    decodes."""
    if not decodes:
        return torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    used = [blocks_for(cached + 1, block_size) for _, _, cached, _ in decodes]  # incl. the new
    longest = max(used)
    if bucketed:
        longest = blocks_for(padded_length(longest * block_size), block_size)
    # Padding repeats the row's first block: any block in a table has been zeroed or written,
    # so it holds finite numbers (a NaN would survive its zero attention weight).
    tables = [table for _, table, _, _ in decodes]
    padded = [table[:n] + [table[0]] * (longest - n) for table, n in zip(tables, used, strict=True)]
    cached = torch.tensor([cached for _, _, cached, _ in decodes], dtype=torch.long)  # (B,)
    return torch.tensor(padded, dtype=torch.long), cached
