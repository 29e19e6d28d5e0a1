"""BlockQueries: what the block ledger (``scheduler.block_allocator.BlockAllocator``) answers
without changing anything: counts, the states the auditor and the web page read, and prefix
lookups. A mixin of that class, over its fields."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from protocol.blocks import blocks_for


class BlockQueries:
    """BlockAllocator's read-only methods."""

    def blocks_for_length(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return blocks_for(num_tokens, self.block_size)

    @property
    def num_free(self) -> int:
        """How many blocks are free, cached or not: what an allocation may take."""
        return len(self._free_set) + len(self._evictable)

    @property
    def free_blocks(self) -> frozenset[int]:
        """Every free block id, cached or not."""
        return frozenset(self._free_set.union(self._evictable))

    @property
    def uncached_free_blocks(self) -> AbstractSet[int]:
        """The free blocks that hold nothing worth keeping (the live set: read it only)."""
        return self._free_set

    @property
    def eviction_queue(self) -> list[int]:
        """The cached-free blocks, the next to be evicted first."""
        return list(self._evictable)

    @property
    def allocated_blocks(self) -> frozenset[int]:
        """The held block ids."""
        return frozenset(self._ref_counts)

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0 when free)."""
        self._check_range(block_id)
        return self._ref_counts.get(block_id, 0)

    @property
    def block_states(self) -> bytearray:
        """One byte per block: FREE, CACHED (cached-free), HELD (one holder) or SHARED (several),
        as in ``protocol.monitor``. The live array, not a copy: callers only read it."""
        return self._states

    # The mappings below are the live ledgers, not copies (the audit reads 100k-entry pools).
    @property
    def ref_counts(self) -> Mapping[int, int]:
        """``{block_id: holders}`` for every held block."""
        return self._ref_counts

    @property
    def cached_blocks(self) -> Mapping[int, bytes]:
        """``{block_id: hash}`` for every cached block, held or free."""
        return self._hash_of

    @property
    def hash_index(self) -> Mapping[bytes, int]:
        """The index, ``{hash: block_id}``."""
        return self._by_hash

    @property
    def num_cached(self) -> int:
        """How many blocks are in the index."""
        return len(self._by_hash)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` that the index holds."""
        found = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        return found
