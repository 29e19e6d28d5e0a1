"""PrefixCache: how the scheduler uses the allocator's hash index (torch-free).

A request is admitted with the longest run of its full blocks that the index holds (a hit takes a
reference on each) and starts computing after them; at least one token is always computed, for
the logits. Only the blocks a hit does not cover, plus the cached-free ones it takes out of the
free pool, count against the pool and the watermark, and only the tokens after them against
the budget.

A full block is offered to the index once its K/V is planned by an earlier step (the worker runs
steps in order, so a later step reads it) and all its tokens are known (with overlap, a block's
last token may still be pending). Blocks a step fills are offered after its admissions, so no
hit reads K/V the same step computes (a compiled step writes its K/V after its graph). When the
worker's rows are lost, the index goes with them: no request may hit K/V that the next worker
never computed.

With KV events on (``record``), every hash the index gains, loses to an eviction or forgets is
told to a ``KvEventLog``. The recording runs beside the cache's own work and changes none of it.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.block_allocator import BlockAllocator
from scheduler.kv_events import KvEventLog
from scheduler.request import Request


class PrefixCache:
    """Lookups at admission, offers as blocks fill, and the query/hit counters (in tokens)."""

    def __init__(self, allocator: BlockAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.queries = 0  # tokens of admitted requests, every admission counted
        self.hits = 0  # of those, tokens found in the cache
        self.events: KvEventLog | None = None

    def record(self, events: KvEventLog | None) -> None:
        """Tell ``events`` of every change to the index from now on (None: stop)."""
        self.events = events
        self.allocator.watch_evictions(None if events is None else events.removed)

    def clear(self) -> None:
        """Forget every hash: the K/V they named went with the worker's rows."""
        self.allocator.clear_cache()
        if self.events is not None:
            self.events.cleared()

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop the hashes of these blocks: the steps that would write their K/V were lost."""
        for digest in self.allocator.forget(blocks):
            if self.events is not None:
                self.events.removed(digest)

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix, leaving at least one token
        to compute."""
        if not self.enabled:
            return []
        size = self.allocator.block_size
        usable = (request.num_tokens - 1) // size
        hashes = request.hash_blocks(usable, size)
        return self.allocator.lookup(hashes[:usable])

    def free_blocks_taken(self, need: int, hits: list[int]) -> int:
        """Free blocks an admission of ``need`` blocks with these hits consumes: the new ones,
        and the hits that are cached-free."""
        return need - len(hits) + sum(1 for block in hits if self.allocator.ref_count(block) == 0)

    def admitted(self, request: Request, num_hits: int) -> None:
        """Account an admission whose first ``num_hits`` blocks are hits: the request starts
        computing after them."""
        request.take_cached(num_hits, self.allocator.block_size)
        self.queries += request.num_tokens
        self.hits += request.num_computed

    def offer(self, request: Request) -> None:
        """Offer the index every full block whose K/V is planned and whose tokens are known."""
        self.offer_all((request,))

    def offer_all(self, requests: Iterable[Request]) -> None:
        """``offer`` each of ``requests``. Every step offers every request it computes or
        samples, and a block fills once in ``block_size`` decode steps: the test comes first,
        on fields, with no call per request."""
        if not self.enabled:
            return
        size = self.allocator.block_size
        for request in requests:
            known = len(request.prompt_token_ids) + len(request.output_token_ids)
            full = min(request.num_computed, known) // size
            if full > request.num_blocks_cached:
                hashes = request.hash_blocks(full, size)
                first = request.num_blocks_cached
                if self.events is not None:
                    self._cache_recorded(request, first, full, hashes, self.events)
                else:
                    for index in range(first, full):
                        self.allocator.cache(request.block_ids[index], hashes[index])
                request.offered(full)

    def _cache_recorded(
        self, request: Request, first: int, full: int, hashes: list[bytes], events: KvEventLog
    ) -> None:
        """Index blocks ``first..full-1`` of ``request`` as ``offer_all`` does, and record each
        run of them that joined the index (a block whose hash another block already holds does
        not join: the first copy stays the one indexed)."""
        size, cached = self.allocator.block_size, self.allocator.cached_blocks
        joined = []
        for index in range(first, full):
            block = request.block_ids[index]
            new = block not in cached
            joined.append(self.allocator.cache(block, hashes[index]) and new)
        start = None
        for index, ok in enumerate([*joined, False], start=first):
            if ok and start is None:
                start = index
            elif not ok and start is not None:
                parent = hashes[start - 1] if start else None
                tokens = request.token_slice(start * size, index * size)
                events.stored(hashes[start:index], parent, tokens, size)
                start = None
