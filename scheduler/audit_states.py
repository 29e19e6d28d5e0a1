"""The audit of the allocator's ``block_states``: the byte per block the web page draws.

The allocator keeps those bytes up to date with every change, so a snapshot of the pool is one
copy instead of a walk over the ledger. This checks that they say what the ledger says, after
``audit_pool`` has checked the ledger itself: a held block is HELD (one holder) or SHARED
(several), a cached-free one CACHED, and the rest FREE. It reads each held and cached-free
block's byte in C (a pool may hold 100k blocks), and the counts of each state settle the rest.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from itertools import compress
from operator import itemgetter

from protocol.monitor import CACHED, FREE, HELD, SHARED, STATES
from scheduler.errors import InvariantViolation
from scheduler.scheduler import Scheduler


def audit_block_states(scheduler: Scheduler, shared: set[int] | None = None) -> None:
    """Every block's byte matches its place in the ledger. ``shared``: the blocks with several
    holders, as ``audit_pool`` returned them (found again when not given)."""
    allocator = scheduler.allocator
    states = allocator.block_states
    counts = allocator.ref_counts
    evictable = allocator.eviction_queue
    if len(states) != allocator.num_blocks:
        raise InvariantViolation(
            f"the block states cover {len(states)} blocks of {allocator.num_blocks}"
        )
    if shared is None:
        shared = set()
        if sum(counts.values()) != len(counts):  # some block has several holders (in C)
            shared = set(compress(counts.keys(), map((1).__lt__, counts.values())))
    _expect(states, shared, SHARED, "shared")
    held = _picked(states, counts.keys())
    if held.count(HELD) + held.count(SHARED) != len(held):
        _expect(states, counts.keys(), HELD, "held", allowed=(HELD, SHARED))
    if held.count(SHARED) != len(shared):
        block = min(b for b in counts if (states[b] == SHARED) != (b in shared))
        holders = counts[block]
        raise InvariantViolation(
            f"block {block} is shown as {STATES[states[block]]} but has {holders} holder(s)"
        )
    if _picked(states, evictable).count(CACHED) != len(evictable):
        _expect(states, evictable, CACHED, "cached-free")
    # Held and cached-free blocks are right and the states partition the pool (audit_pool):
    # the uncached-free blocks are the rest, so their count settles them.
    free = len(allocator.uncached_free_blocks)
    if states.count(FREE) != free:
        _expect(states, allocator.uncached_free_blocks, FREE, "free")


def _picked(states: bytearray, blocks: Collection[int]) -> tuple[int, ...]:
    """The bytes of ``blocks``, read in C (itemgetter: no Python call per block)."""
    if len(blocks) < 2:
        return tuple(states[block] for block in blocks)
    return itemgetter(*blocks)(states)


def _expect(
    states: bytearray,
    blocks: Iterable[int],
    state: int,
    what: str,
    allowed: tuple[int, ...] | None = None,
) -> None:
    """Raise naming the lowest block in ``blocks`` whose byte is not in ``allowed``."""
    allowed = allowed or (state,)
    wrong = [block for block in blocks if states[block] not in allowed]
    if wrong:
        block = min(wrong)
        raise InvariantViolation(
            f"block {block} is {what} but its state byte says {STATES[states[block]]}"
        )
