"""Padded sizes, so that a long run meets only a few tensor shapes.

oneDNN builds (and caches) one primitive per matmul shape. Served traffic gives a new token
count, decode batch or context length almost every step, and a primitive per shape would keep
the worker's resident memory growing for as long as new shapes kept coming. Padding each size
up to a bucket bounds the shapes a run can ever
meet, so the primitives stop coming after the first minutes and memory stays flat. The padding
work is small: buckets are fine where sizes are small, and coarse only where a step is large.
"""

from __future__ import annotations

from protocol.blocks import ceil_div


def padded_count(n: int) -> int:
    """Token counts and batch sizes: exact to 8, then multiples of 4 to 64, of 16 to 256, of
    64 to 1024 and of 256 beyond (at most 3 padding rows below 64, and under a quarter above).
    Exact to 8: a request verifying its drafts alone is a step of ``k + 1`` rows, and on the
    CPU each padding row of a small step costs about a row's share of the 4-bit weights'
    arithmetic, where the rows themselves only stream them (docs/speculative.md)."""
    if n <= 8:
        return n
    for limit, multiple in ((64, 4), (256, 16), (1024, 64)):
        if n <= limit:
            return _round_up(n, multiple)
    return _round_up(n, 256)


def padded_length(n: int) -> int:
    """Attention context lengths (tokens): multiples of 32 to 256, of 64 to 1024, of 256 beyond
    (padded positions are masked out, so they cost a little gather work and nothing else)."""
    if n <= 256:
        return _round_up(n, 32)
    if n <= 1024:
        return _round_up(n, 64)
    return _round_up(n, 256)


def _round_up(n: int, multiple: int) -> int:
    return ceil_div(n, multiple) * multiple
