"""PoolSums: the checksums of the K/V in the pool, as the worker reported them, checked after a
re-attach (docs/kv_pool.md).

On a shared pool the worker returns, with each step, a CRC-32 of every block the step filled
(``StepResult.block_sums``), and one of the slots each item wrote into the block it left partial
(``StepResult.range_sums``: block, first slot, end slot). The scheduler keeps the latest sum of
each block, and of each such slot range, that a request still current wrote (a result for an
aborted or preempted request's step may sum a block already handed to another). After a
re-attach, the first step the engine sends asks the new worker for the sums of the kept K/V
(every full block of a running request, and the cached-free blocks, with ``--audit``, else a
seeded sample; and every recorded range of each running request's partial last block, below
its computed tokens), before any item reads them. A block with a sum that differs is named with
its holders, loses its hash, and its holders are recomputed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.batch import Batch
from scheduler.scheduler import Scheduler

SAMPLE = 64  # blocks checked after a re-attach without --audit

log = logging.getLogger("nanoserve.scheduler")


@dataclass(frozen=True)
class Check:
    """The kept K/V a re-attach checks: whole blocks, and (block, first slot, end slot) ranges
    of partial blocks."""

    blocks: list[int] = field(default_factory=list)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.blocks or self.ranges)


def filled(start: int, num_tokens: int, block_ids: list[int], block_size: int) -> list[int]:
    """The blocks a chunk of ``num_tokens`` from ``start`` fills (reaches their last slot)."""
    end = start + num_tokens
    return block_ids[start // block_size : end // block_size]


def partial(
    start: int, num_tokens: int, block_ids: list[int], block_size: int
) -> tuple[int, int, int] | None:
    """(block, first slot, end slot) a chunk writes into the block it ends inside, or None
    when it ends at a block's end."""
    end = start + num_tokens
    if not end % block_size:
        return None
    first = max(start, end - end % block_size) % block_size
    return block_ids[end // block_size], first, end % block_size


class PoolSums:
    """The latest reported sum of each full block, and of the slot ranges written into each
    partial block."""

    def __init__(self, seed: int = 0) -> None:
        self.sums: dict[int, int] = {}
        # block -> [(first slot, end slot, sum)]: the ranges its writer wrote while it was
        # partial, in slot order (a write from slot s supersedes every range that reaches past s)
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}
        self._rng = random.Random(seed)
        self.corrupt_total = 0  # blocks that failed their check

    def record(
        self,
        batch: Batch,
        reported: list[tuple[int, int]],
        scheduler: Scheduler,
        ranges: Sequence[tuple[int, int, int, int]] = (),
    ) -> None:
        """Keep the sums a step reported for the blocks its current chunks filled, and for the
        slots they wrote into the blocks they left partial."""
        if not reported and not ranges:
            return
        size = scheduler.allocator.block_size
        mine: set[int] = set()
        written: set[tuple[int, int, int]] = set()
        for chunk in batch.chunks:
            if scheduler.is_current(chunk):
                block_ids = chunk.request.block_ids
                mine.update(filled(chunk.start, chunk.num_tokens, block_ids, size))
                tail = partial(chunk.start, chunk.num_tokens, block_ids, size)
                if tail is not None:
                    written.add(tail)
        for block, crc in reported:
            if block in mine:
                self.sums[block] = crc
        for block, first, end, crc in ranges:
            if (block, first, end) in written:
                kept = [r for r in self.ranges.get(block, ()) if r[1] <= first]
                self.ranges[block] = [*kept, (first, end, crc)]

    def to_verify(self, scheduler: Scheduler, everything: bool) -> Check:
        """The kept K/V to check: the blocks with a sum that a running request holds below its
        computed tokens, and the cached-free ones (a sample of ``SAMPLE`` unless
        ``everything``); and the recorded ranges of the running requests' partial blocks."""
        size = scheduler.allocator.block_size
        blocks = {
            block
            for request in scheduler.running
            for block in request.block_ids[: request.num_computed // size]
        }
        blocks.update(scheduler.allocator.eviction_queue)
        known = sorted(b for b in blocks if b in self.sums)
        if not everything and len(known) > SAMPLE:
            known = sorted(self._rng.sample(known, SAMPLE))
        return Check(known, self._ranges_to_verify(scheduler))

    def _ranges_to_verify(self, scheduler: Scheduler) -> list[tuple[int, int, int]]:
        """(block, first, end) of every recorded range of each running request's partial last
        block, below its computed tokens (all of them: one block a request, at most)."""
        size = scheduler.allocator.block_size
        asked = []
        for request in scheduler.running:
            computed = request.num_computed % size
            if not computed:
                continue
            block = request.block_ids[request.num_computed // size]
            asked += [(block, a, b) for a, b, _ in self.ranges.get(block, ()) if b <= computed]
        return asked

    def check(
        self,
        reported: list[tuple[int, int]],
        ranges: list[tuple[int, int, int, int]],
        scheduler: Scheduler,
    ) -> None:
        """After a re-attach: recompute whoever holds a block whose K/V is not what was
        written (the whole block's, or a range of slots of a partial block), naming it (never
        serve a token computed from it)."""
        for block, slots in self.mismatches(reported, ranges):
            holders = scheduler.drop_corrupt(block)
            log.error(
                "KV block %d fails its checksum after the re-attach (held by %s%s): %s",
                block,
                ", ".join(holders) or "no request, cached-free",
                f"; {slots} of its partial last block" if slots else "",
                "recomputing" if holders else "dropped from the prefix cache",
            )

    def mismatches(
        self,
        reported: list[tuple[int, int]],
        ranges: Sequence[tuple[int, int, int, int]] = (),
    ) -> list[tuple[int, str]]:
        """The blocks with a reported sum that is not the recorded one, each with what failed
        ("" for the whole block, "slots a to b" for a range of a partial block)."""
        bad = [(block, "") for block, crc in reported if self.sums.get(block, crc) != crc]
        for block, _ in bad:
            del self.sums[block]
        recorded = {(b, a, e): crc for b, kept in self.ranges.items() for a, e, crc in kept}
        for block, first, end, crc in ranges:
            if recorded.get((block, first, end), crc) != crc and block not in dict(bad):
                bad.append((block, f"slots {first} to {end - 1}"))
                del self.ranges[block]
        self.corrupt_total += len(bad)
        return bad
