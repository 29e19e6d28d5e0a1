"""BlockAllocator: the ledger of the KV cache's blocks, with the prefix cache's index.

Every block id in ``range(num_blocks)`` is in exactly one of three states:

- **held**: one or more requests hold it; its reference count is the number of holders;
- **cached-free**: nobody holds it, but it still holds the K/V of a full block whose hash is in
  the index, so a request with the same prefix can take it back (a cache hit);
- **uncached-free**: nobody holds it and it holds nothing worth keeping.

A held block may be cached too (hashed and indexed): that is how a running request's prefix is
shared. Free blocks are handed out uncached first; only when none is left is a cached-free block
evicted (its hash dropped), least recently freed first. The scheduler frees a request's blocks
deepest first, so a chain is evicted from its tail and its shared head lasts longest.

Which free blocks a request gets matters to the worker's attention, which streams a request's
K/V about twice as fast when its blocks are adjacent (docs/performance.md): ``allocate`` keeps a
request's blocks in runs, and evicts a cached block only when no uncached-free one is left.

``block_states`` mirrors the ledger one byte per block (free, cached-free, held by one, shared),
kept up to date by every change, so the web page's snapshot of a large pool is one copy
(``scheduler.snapshot``); the audit checks it against the ledger.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from protocol.monitor import CACHED, FREE, HELD, SHARED
from scheduler.block_queries import BlockQueries
from scheduler.errors import BlockLedgerError, OutOfBlocks

_FREE_BYTE = bytes([FREE])


class BlockAllocator(BlockQueries):
    """Hands out, shares and takes back KV cache block ids. Misuse raises at once. What it
    answers without changing anything is in ``BlockQueries``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_set: set[int] = set(range(num_blocks))
        # Where the next run is looked for: just past the last one placed. It sweeps the pool,
        # spreading writes over it as the FIFO free list before it did.
        self._cursor = 0
        # Cached-free blocks in eviction order: least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}  # every cached block, held or free
        self._by_hash: dict[bytes, int] = {}  # the index: hash -> block
        self._states = bytearray([FREE]) * num_blocks  # each block's state, as the page shows it
        self._on_evict: Callable[[bytes], None] | None = None  # KV events (watch_evictions)

    # -- changes -----------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """Take ``n`` free blocks, uncached ones first, or raise OutOfBlocks and take none.

        Where from: the blocks right after ``after`` (the request's last block) while they are
        uncached-free; then the start of a run of uncached-free blocks at least ``room`` long
        (all the request expects to hold from here on), looked for from the cursor on, which
        then moves past the run; else a run of just what is left; else single uncached-free
        blocks from the cursor on; then a run of cached-free ones around the least recently
        freed (``_evict_run``); else cached-free ones, least recently freed first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free of {self.num_blocks}")
        ids: list[int] = []
        if after is not None:
            self._check_range(after)
            block_id = after + 1
            while len(ids) < n and block_id < self.num_blocks and self._states[block_id] == FREE:
                ids.append(self._take_free(block_id))
                block_id += 1
        if len(ids) < n:
            ids += [self._take_free(block_id) for block_id in self._run(n - len(ids), room)]
        while len(ids) < n and self._free_set:  # no run: single blocks
            block_id = self._find(_FREE_BYTE)
            self._cursor = block_id + 1
            ids.append(self._take_free(block_id))
        if len(ids) < n:
            ids += self._evict_run(n - len(ids))
        while len(ids) < n:  # no run: the least recently freed, one at a time
            ids.append(self._take_cached(next(iter(self._evictable))))
        return ids

    def _run(self, k: int, room: int) -> range:
        """The first ``k`` blocks of a run of uncached-free blocks ``max(k, room)`` long, else
        of one ``k`` long, else none; the cursor moves past the run."""
        for span in (room, k) if room > k else (k,):
            start = self._find(_FREE_BYTE * span)
            if start >= 0:
                self._cursor = start + span
                return range(start, start + k)
        return range(0)

    def _evict_run(self, k: int) -> list[int]:
        """With no uncached-free block left: ``k`` adjacent cached-free blocks around the least
        recently freed one, below it first (a request's blocks are adjacent and freed deepest
        first), evicted and held; [] when there is no such run."""
        low = high = next(iter(self._evictable))
        while high - low + 1 < k and low > 0 and self._states[low - 1] == CACHED:
            low -= 1
        while high - low + 1 < k and high + 1 < self.num_blocks:
            if self._states[high + 1] != CACHED:
                break
            high += 1
        if high - low + 1 < k:
            return []
        return [self._take_cached(block_id) for block_id in range(low, high + 1)]

    def _find(self, pattern: bytes) -> int:
        """Where ``pattern`` (FREE bytes) first occurs from the cursor on, else from the start;
        -1 if nowhere (bytearray.find: C speed on 100k-block pools)."""
        found = self._states.find(pattern, self._cursor)
        return found if found >= 0 else self._states.find(pattern, 0)

    def _take_free(self, block_id: int) -> int:
        self._free_set.remove(block_id)
        self._hold(block_id)
        return block_id

    def _take_cached(self, block_id: int) -> int:
        """Evict a cached-free block (its hash leaves the index) and hold it."""
        del self._evictable[block_id]
        digest = self._hash_of.pop(block_id)
        del self._by_hash[digest]
        if self._on_evict is not None:
            self._on_evict(digest)
        self._hold(block_id)
        return block_id

    def watch_evictions(self, on_evict: Callable[[bytes], None] | None) -> None:
        """Call ``on_evict(hash)`` whenever an eviction drops a hash from the index."""
        self._on_evict = on_evict

    def _hold(self, block_id: int) -> None:
        self._ref_counts[block_id] = 1
        self._states[block_id] = HELD

    def take(self, block_ids: Sequence[int]) -> list[int]:
        """Add a holder to each cached block (a cache hit); a cached-free one leaves the
        eviction queue. Every id is checked before any is taken."""
        for block_id in block_ids:
            self._check_range(block_id)
            if block_id not in self._hash_of:
                raise BlockLedgerError(f"block {block_id} taken as a hit but it is not cached")
        if len(set(block_ids)) != len(block_ids):
            raise BlockLedgerError(f"blocks {list(block_ids)} taken twice in one hit")
        for block_id in block_ids:
            if block_id in self._evictable:
                del self._evictable[block_id]
            count = self._ref_counts.get(block_id, 0) + 1
            self._ref_counts[block_id] = count
            self._states[block_id] = HELD if count == 1 else SHARED
        return list(block_ids)

    def cache(self, block_id: int, digest: bytes) -> bool:
        """Index a held, full block under ``digest``; False (and nothing changes) when another
        block already holds that hash: the first copy stays the one that is shared."""
        self._check_range(block_id)
        if block_id not in self._ref_counts:
            raise BlockLedgerError(f"block {block_id} cached but it is not allocated")
        known = self._hash_of.get(block_id)
        if known is not None:
            if known != digest:
                raise BlockLedgerError(f"block {block_id} cached under two hashes")
            return True
        if digest in self._by_hash:
            return False
        self._hash_of[block_id] = digest
        self._by_hash[digest] = block_id
        return True

    def free_all(self, block_ids: Sequence[int]) -> None:
        """Drop one holder from each block, in the order given; a block with no holder left
        becomes cached-free (at the back of the eviction queue) or uncached-free.

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

    def clear_cache(self) -> int:
        """Forget every hash (the K/V they named is gone): cached-free blocks become
        uncached-free, held ones stay held. Returns how many blocks were cached."""
        dropped = len(self._hash_of)
        for block_id in self._evictable:
            self._free_set.add(block_id)
            self._states[block_id] = FREE
        self._evictable.clear()
        self._hash_of.clear()
        self._by_hash.clear()
        return dropped

    def forget(self, block_ids: Iterable[int]) -> list[bytes]:
        """Drop the hashes of these blocks (their K/V may never have been written): a held one
        stays held, a cached-free one becomes uncached-free. Returns the hashes dropped."""
        dropped = []
        for block_id in block_ids:
            digest = self._hash_of.pop(block_id, None)
            if digest is None:
                continue
            del self._by_hash[digest]
            dropped.append(digest)
            if block_id in self._evictable:
                del self._evictable[block_id]
                self._free_set.add(block_id)
                self._states[block_id] = FREE
        return dropped

    def _release(self, block_id: int) -> None:
        count = self._ref_counts[block_id] - 1
        if count:
            self._ref_counts[block_id] = count
            if count == 1:
                self._states[block_id] = HELD
            return
        del self._ref_counts[block_id]
        if block_id in self._hash_of:
            self._evictable[block_id] = None
            self._states[block_id] = CACHED
        else:
            self._free_set.add(block_id)
            self._states[block_id] = FREE

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockLedgerError(f"block {block_id} is out of range 0..{self.num_blocks - 1}")
