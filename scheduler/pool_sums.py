"""PoolSums: the checksum of each full block's K/V, as the worker reported it, checked after a
re-attach (docs/kv_pool.md).

On a shared pool the worker returns, with each step, a CRC-32 of every block the step filled
(``StepResult.block_sums``). The scheduler keeps the latest sum of each block that a request
still current filled (a result for an aborted or preempted request's step may sum a block
already handed to another). After a re-attach, the first step the engine sends asks the new
worker for the sums of the kept K/V (every full block of a running request, and the cached-free
blocks, with ``--audit``; else a seeded sample), before any item reads them. A block whose sum
differs is named with its holders, loses its hash, and its holders are recomputed.
"""

from __future__ import annotations

import random

from scheduler.batch import Batch
from scheduler.scheduler import Scheduler

SAMPLE = 64  # blocks checked after a re-attach without --audit


def filled(start: int, num_tokens: int, block_ids: list[int], block_size: int) -> list[int]:
    """The blocks a chunk of ``num_tokens`` from ``start`` fills (reaches their last slot)."""
    end = start + num_tokens
    return block_ids[start // block_size : end // block_size]


class PoolSums:
    """The latest reported sum of each full block."""

    def __init__(self, seed: int = 0) -> None:
        self.sums: dict[int, int] = {}
        self._rng = random.Random(seed)
        self.corrupt_total = 0  # blocks that failed their check

    def record(self, batch: Batch, reported: list[tuple[int, int]], scheduler: Scheduler) -> None:
        """Keep the sums a step reported for the blocks its current chunks filled."""
        if not reported:
            return
        size = scheduler.allocator.block_size
        mine: set[int] = set()
        for chunk in batch.chunks:
            if scheduler.is_current(chunk):
                mine.update(filled(chunk.start, chunk.num_tokens, chunk.request.block_ids, size))
        for block, crc in reported:
            if block in mine:
                self.sums[block] = crc

    def to_verify(self, scheduler: Scheduler, everything: bool) -> list[int]:
        """The kept blocks to check: those with a sum that a running request holds below its
        computed tokens, and the cached-free ones; a sample of ``SAMPLE`` unless
        ``everything``."""
        size = scheduler.allocator.block_size
        blocks = {
            block
            for request in scheduler.running
            for block in request.block_ids[: request.num_computed // size]
        }
        blocks.update(scheduler.allocator.eviction_queue)
        known = sorted(b for b in blocks if b in self.sums)
        if everything or len(known) <= SAMPLE:
            return known
        return sorted(self._rng.sample(known, SAMPLE))

    def mismatches(self, reported: list[tuple[int, int]]) -> list[int]:
        """The blocks whose reported sum is not the recorded one."""
        bad = [block for block, crc in reported if self.sums.get(block, crc) != crc]
        self.corrupt_total += len(bad)
        for block in bad:
            del self.sums[block]
        return bad
