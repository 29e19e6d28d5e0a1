"""BlockAllocator: the pool ledger and its misuse errors."""

from __future__ import annotations

import pytest

from scheduler.block_allocator import BlockAllocator
from scheduler.errors import BlockLedgerError, OutOfBlocks


def test_allocate_and_free_round_trip() -> None:
    pool = BlockAllocator(8, 4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 5
    assert pool.allocated_blocks == frozenset(ids)
    assert pool.free_blocks == frozenset(range(8)) - set(ids)
    assert all(pool.ref_count(b) == 1 for b in ids)
    pool.free_all(ids)
    assert pool.num_free == 8 and not pool.allocated_blocks and pool.ref_count(ids[0]) == 0


def test_allocate_too_many_raises_and_takes_nothing() -> None:
    pool = BlockAllocator(4, 4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocks, match="asked for 2 blocks, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.parametrize("n, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_for_length_is_a_ceiling(n: int, blocks: int) -> None:
    assert BlockAllocator(10, 4).blocks_for_length(n) == blocks


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockAllocator(4, 4)
    a, b = pool.allocate(2)
    pool.free_all([a])
    with pytest.raises(BlockLedgerError, match=f"block {a} freed but it is not allocated"):
        pool.free_all([b, a])
    assert pool.ref_count(b) == 1  # the good id in the bad call was not freed either


def test_free_of_never_allocated_and_duplicate_in_one_call() -> None:
    pool = BlockAllocator(4, 4)
    with pytest.raises(BlockLedgerError, match="block 2 freed but it is not allocated"):
        pool.free_all([2])
    (a,) = pool.allocate(1)
    with pytest.raises(BlockLedgerError, match=f"block {a} freed"):
        pool.free_all([a, a])


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_ids_raise(bad: int) -> None:
    pool = BlockAllocator(4, 4)
    with pytest.raises(BlockLedgerError, match=f"block {bad} is out of range 0..3"):
        pool.free_all([bad])


def test_bad_geometry_raises() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0, 4)
