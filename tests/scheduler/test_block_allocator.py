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


# -- placement: adjacent blocks where the pool allows (the ledger rules above do not change) ----
def test_a_request_grows_into_the_block_after_its_last():
    pool = BlockAllocator(64, 4)
    a = pool.allocate(2, room=8)
    b = pool.allocate(2, room=8)
    assert a == [0, 1] and b == [8, 9]  # b starts past a's room
    for _ in range(6):  # interleaved growth, as a batch of decodes crosses block boundaries
        a += pool.allocate(1, after=a[-1], room=8 - len(a))
        b += pool.allocate(1, after=b[-1], room=8 - len(b))
    assert a == list(range(8)) and b == list(range(8, 16))


def test_a_taken_neighbour_sends_growth_to_a_new_run_with_room():
    pool = BlockAllocator(32, 4)
    a = pool.allocate(2, room=2)
    b = pool.allocate(1, room=1)  # right behind a: a's next block is gone
    assert (a, b) == ([0, 1], [2])
    assert pool.allocate(2, after=a[-1], room=4) == [3, 4]  # a run of 4 from the cursor
    assert pool.allocate(1, room=1) == [7]  # past the 4 the run left room for


def test_without_a_run_single_blocks_then_the_cached_ones_least_recent_first():
    pool = BlockAllocator(8, 4)
    held = pool.allocate(8)
    assert held == list(range(8))
    pool.cache(0, b"h0")
    pool.cache(6, b"h6")
    pool.free_all([6, 0, 3, 5])  # uncached-free: 3 and 5, no two adjacent
    assert pool.allocate(3, room=3) == [3, 5, 6]  # then the least recently freed cached block
    assert pool.lookup([b"h6"]) == [] and pool.lookup([b"h0"]) == [0]


def test_after_takes_only_uncached_free_neighbours():
    pool = BlockAllocator(16, 4)
    a = pool.allocate(1)
    b = pool.allocate(1, room=1)
    pool.cache(b[0], b"b")
    pool.free_all(b)  # cached-free: worth keeping, so a does not grow into it
    grown = pool.allocate(1, after=a[0], room=1)
    assert grown != b and pool.lookup([b"b"]) == b
    with pytest.raises(BlockLedgerError, match="block 16 is out of range"):
        pool.allocate(1, after=16)


def test_a_full_cache_gives_a_run_around_the_least_recently_freed():
    """Every free block cached: the run below the least recently freed block is what the
    eviction queue would give next (a chain freed deepest first), now in ascending order;
    where no run is long enough, the queue's order."""
    pool = BlockAllocator(8, 4)
    held = pool.allocate(8)
    for block in held:
        pool.cache(block, bytes([block]))
    pool.free_all([3, 2, 1, 0])  # one request's chain, deepest first
    pool.free_all([7, 6, 5, 4])
    assert pool.eviction_queue == [3, 2, 1, 0, 7, 6, 5, 4]
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [0, 7]  # 0 has no cached neighbour left: one at a time
    assert pool.eviction_queue == [6, 5, 4] and pool.lookup([bytes([4])]) == [4]
