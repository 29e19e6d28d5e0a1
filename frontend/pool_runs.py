"""The pool as browsers get it: ``PoolStates`` (one byte per block, from the scheduler) and the
running requests' block lists turned into runs (``protocol.monitor.PoolRuns``).

A frontend does this once per snapshot, whatever the number of open pages, so the scheduler
only copies its bytes. ``decode_runs`` undoes the runs, for tests and tools. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import repeat

from protocol.monitor import HELD, SHARED, STATES, PoolRuns, PoolStates, RequestRow

_RUN = re.compile(rb"\x00+|\x01+|\x02+|\x03+")  # one state's run of bytes (FREE..SHARED)


def pool_runs(pool: PoolStates, requests: Sequence[RequestRow]) -> PoolRuns:
    """The pool in block order as ``(state, owner set, length)`` runs. Owner set 0 is empty
    (free blocks), ``1 + i`` is ``requests[i]`` alone (the running rows come first), and the
    sets of shared blocks follow. ValueError when the states and the rows disagree (a frame
    from another build, or a corrupt one)."""
    states = pool.states
    if len(states) != pool.num_blocks or states.translate(None, b"\x00\x01\x02\x03"):
        raise ValueError(f"{len(states)} state bytes for {pool.num_blocks} blocks, or a bad one")
    running = [row for row in requests if row.running]
    owner: dict[int, int] = {}  # held block -> its owner set (its last holder's, if shared)
    owner_sets: list[list[int]] = [[]]
    for index, row in enumerate(running):
        owner_sets.append([index])
        owner.update(zip(row.blocks, repeat(index + 1)))
    runs: list[int] = []
    try:
        if SHARED in states:
            _share(states, running, owner, owner_sets)
        for match in _RUN.finditer(states):
            start, end = match.span()
            state = states[start]
            if state < HELD:
                runs += (state, 0, end - start)
            else:
                runs += _owner_runs(state, owner, start, end)
    except KeyError as missing:
        block = missing.args[0]
        raise ValueError(f"block {block} is {STATES[states[block]]} but nobody holds it") from None
    except IndexError:
        raise ValueError(f"a request holds a block out of range 0..{len(states) - 1}") from None
    return PoolRuns(
        num_blocks=pool.num_blocks,
        block_size=pool.block_size,
        watermark_blocks=pool.watermark_blocks,
        runs=runs,
        owner_sets=owner_sets,
    )


def _share(
    states: bytes,
    running: list[RequestRow],
    owner: dict[int, int],
    owner_sets: list[list[int]],
) -> None:
    """Give each shared block the owner set of all its holders (shared sets are few)."""
    holders: dict[int, list[int]] = {}
    for index, row in enumerate(running):
        for block in row.blocks:
            if states[block] == SHARED:
                holders.setdefault(block, []).append(index)
    for block, indexes in holders.items():
        owner[block] = _owner_set(owner_sets, indexes)


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


def _owner_set(owner_sets: list[list[int]], holders: list[int]) -> int:
    """The index of ``holders`` in ``owner_sets``, appended when new."""
    for index in range(len(owner_sets) - 1, 0, -1):
        if owner_sets[index] == holders:
            return index
    owner_sets.append(holders)
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
