"""BlockAllocator: the ledger of the KV cache's blocks.

Every block id in ``range(num_blocks)`` is either free or allocated, and each allocated block
counts its holders (a reference count), so that prefix sharing can later let several requests
hold one block and the pool invariant becomes "reference count equals the number of holders".
Today every allocation has exactly one holder.
"""

from __future__ import annotations

from collections import deque

from scheduler.errors import BlockLedgerError, OutOfBlocks


class BlockAllocator:
    """Hands out and takes back KV cache block ids. Misuse raises at once."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse: a freed block goes to the back, which spreads writes over the pool and
        # makes a block reused too early (a leak's twin) show up sooner in tests.
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(range(num_blocks))
        self._ref_counts: dict[int, int] = {}

    # -- queries -----------------------------------------------------------------------------
    def blocks_for_length(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens (a ceiling division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """How many blocks are free."""
        return len(self._free)

    @property
    def free_blocks(self) -> frozenset[int]:
        """The free block ids."""
        return frozenset(self._free_set)

    @property
    def allocated_blocks(self) -> frozenset[int]:
        """The allocated block ids."""
        return frozenset(self._ref_counts)

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0 when free)."""
        self._check_range(block_id)
        return self._ref_counts.get(block_id, 0)

    @property
    def ref_counts(self) -> dict[int, int]:
        """A copy of ``{block_id: holders}`` for every allocated block."""
        return dict(self._ref_counts)

    # -- changes -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, or raise OutOfBlocks and take none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for block_id in ids:
            self._free_set.discard(block_id)
            self._ref_counts[block_id] = 1
        return ids

    def free_all(self, block_ids: list[int]) -> None:
        """Drop one holder from each block; a block with no holder left becomes free.

        Every id is checked before any is freed, so a bad call changes nothing.
        """
        seen: set[int] = set()
        for block_id in block_ids:
            self._check_range(block_id)
            if block_id in seen or block_id not in self._ref_counts:
                raise BlockLedgerError(f"block {block_id} freed but it is not allocated")
            seen.add(block_id)
        for block_id in block_ids:
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        count = self._ref_counts[block_id] - 1
        if count:
            self._ref_counts[block_id] = count
            return
        del self._ref_counts[block_id]
        self._free.append(block_id)
        self._free_set.add(block_id)

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockLedgerError(f"block {block_id} is out of range 0..{self.num_blocks - 1}")
