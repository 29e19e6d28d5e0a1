"""How tokens fill KV blocks: the arithmetic the scheduler's ledgers and the worker's cache rows
share, so that both count blocks the same way."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b, for positive ``b``."""
    return -(-a // b)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks of ``block_size`` hold ``num_tokens`` tokens."""
    return ceil_div(num_tokens, block_size)
