"""The ledgers as the web page draws them: the pool as runs, the queues as rows (torch-free).

``pool_runs`` reads the allocator and the running requests and returns the pool run-length
encoded (``protocol.monitor.PoolRuns``); ``decode_runs`` undoes that,
for tests and tools. ``request_rows`` lists the queues, counts only: no prompt text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import repeat

from protocol.monitor import CACHED, FREE, HELD, MAX_WAITING_ROWS, SHARED, PoolRuns, RequestRow
from scheduler.block_allocator import BlockAllocator
from scheduler.request import Request

_RUN = re.compile(rb"\x00+|\x01+|\x02+|\x03+")  # one state's run of bytes (FREE..SHARED)


def pool_runs(
    allocator: BlockAllocator, running: Sequence[Request], watermark_blocks: int
) -> PoolRuns:
    """The pool in block order as ``(state, owner set, length)`` runs. Owner set 0 is empty
    (free blocks), ``1 + i`` is ``running[i]`` alone, and the sets of shared blocks follow.

    It runs between iterations, so it touches each block in C only: one byte per block holds
    its state, the commoner kind of free block is the background and only the rarer kind is
    marked one by one, and a regular expression finds the runs. Python works per held block
    and per run."""
    n = allocator.num_blocks
    uncached = allocator.uncached_free_blocks
    if allocator.num_free - len(uncached) > len(uncached):  # mostly cached-free
        states, rare, mark = bytearray([CACHED]) * n, uncached, FREE
    else:
        states, rare, mark = bytearray([FREE]) * n, allocator.eviction_queue, CACHED
    for block in rare:
        states[block] = mark
    owner: dict[int, int] = {}  # held block -> its owner set
    owner_sets: list[list[int]] = [[]]
    for index, request in enumerate(running):
        owner_sets.append([index])
        owner.update(zip(request.block_ids, repeat(index + 1)))
    for block in owner:
        states[block] = HELD
    for block, holders in _shared_holders(allocator, running).items():
        owner[block] = _owner_set(owner_sets, holders)
        states[block] = SHARED
    runs: list[int] = []
    for match in _RUN.finditer(states):
        start, end = match.span()
        state = states[start]
        if state < HELD:
            runs += (state, 0, end - start)
        else:
            runs += _owner_runs(state, owner, start, end)
    return PoolRuns(
        num_blocks=n,
        block_size=allocator.block_size,
        watermark_blocks=watermark_blocks,
        runs=runs,
        owner_sets=owner_sets,
    )


def _owner_runs(state: int, owner: dict[int, int], start: int, end: int) -> list[int]:
    """The runs of held blocks ``start..end-1``: a new run wherever the owner set changes."""
    runs: list[int] = []
    current, length = owner[start], 0
    for block in range(start, end):
        holders = owner[block]
        if holders != current:
            runs += (state, current, length)
            current, length = holders, 0
        length += 1
    runs += (state, current, length)
    return runs


def _shared_holders(
    allocator: BlockAllocator, running: Sequence[Request]
) -> dict[int, tuple[int, ...]]:
    """``{block: indexes of its holders in running}`` for every block with several holders."""
    counts = allocator.ref_counts
    if sum(counts.values()) == len(counts):
        return {}  # every held block has one holder
    shared = {block for block, count in counts.items() if count > 1}
    holders: dict[int, list[int]] = {}
    for index, request in enumerate(running):
        for block in shared.intersection(request.block_ids):
            holders.setdefault(block, []).append(index)
    return {block: tuple(indexes) for block, indexes in holders.items()}


def _owner_set(owner_sets: list[list[int]], holders: tuple[int, ...]) -> int:
    """The index of ``holders`` in ``owner_sets``, appended when new (shared sets are few)."""
    wanted = list(holders)
    for index in range(len(owner_sets) - 1, 0, -1):
        if owner_sets[index] == wanted:
            return index
    owner_sets.append(wanted)
    return len(owner_sets) - 1


def decode_runs(pool: PoolRuns) -> list[tuple[int, tuple[int, ...]]]:
    """``[(state, holders)]`` per block, from the runs; raises if they do not cover the pool."""
    blocks: list[tuple[int, tuple[int, ...]]] = []
    runs = pool.runs
    if len(runs) % 3:
        raise ValueError(f"{len(runs)} run fields are not whole triples")
    for at in range(0, len(runs), 3):
        state, owners, length = runs[at : at + 3]
        blocks += [(state, tuple(pool.owner_sets[owners]))] * length
    if len(blocks) != pool.num_blocks:
        raise ValueError(f"the runs cover {len(blocks)} blocks of {pool.num_blocks}")
    return blocks


def request_rows(
    running: Sequence[Request], waiting: Sequence[Request], now: float
) -> list[RequestRow]:
    """Every running request, then the head of the waiting queue (``MAX_WAITING_ROWS``)."""
    rows = [_row(request, True, now) for request in running]
    for position, request in enumerate(waiting):
        if position == MAX_WAITING_ROWS:
            break
        rows.append(_row(request, False, now))
    return rows


def _row(request: Request, running: bool, now: float) -> RequestRow:
    return RequestRow(
        request_id=request.request_id,
        running=running,
        slot=request.slot,
        num_blocks=len(request.block_ids),
        num_computed=request.num_computed,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_generated,
        max_tokens=request.params.max_tokens,
        num_preemptions=request.num_preemptions,
        age_s=round(now - request.arrival_time, 3),
        num_cached_tokens=request.num_cached_tokens or 0,
    )
