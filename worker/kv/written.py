"""Which blocks and slots a step writes: what the worker sums on a shared pool, so that a check
after a re-attach can tell the K/V a lost worker left from what the ledger expects
(docs/kv_pool.md)."""

from __future__ import annotations

from protocol.messages import StepInput


def partial_ranges(step: StepInput, applied: list, block_size: int) -> list[tuple[int, int, int]]:
    """(block, first slot, end slot) for each item of ``step`` whose tokens end inside a block:
    the slots it writes into the row's last, partial block, which the worker sums on a shared
    pool (a block it fills is summed whole: ``filled_blocks``)."""
    ranges = []
    for item, (row, _) in zip(step.items, applied, strict=True):
        end = item.start + len(item.token_ids)
        if end % block_size:
            first = max(item.start, end - end % block_size) % block_size
            ranges.append((row.block_table[end // block_size], first, end % block_size))
    return ranges


def filled_blocks(step: StepInput, applied: list, block_size: int) -> list[int]:
    """The blocks each item of ``step`` fills (its tokens reach their last position): those the
    worker sums on a shared pool."""
    filled = []
    for item, (row, _) in zip(step.items, applied, strict=True):
        end = item.start + len(item.token_ids)
        for index in range(item.start // block_size, end // block_size):
            filled.append(row.block_table[index])
    return filled
