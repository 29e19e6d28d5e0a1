"""The prefix cache's audit: the hash index, the eviction queue and the holders' cached
prefixes agree with the pool (``scheduler.audit`` runs it after the pool's own audit).

The pool may hold 100k blocks, so the whole-pool checks run in C (set and map operations over
the allocator's live views); per-block detail is computed only to name a culprit.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress, filterfalse

from scheduler.errors import InvariantViolation
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def shared_blocks(counts: Mapping[int, int]) -> set[int]:
    """The blocks with several holders (in C: the pool may hold 100k blocks)."""
    return set(compress(counts.keys(), map((1).__lt__, counts.values())))


def audit_cache(scheduler: Scheduler, shared: set[int] | None = None) -> None:
    """The prefix cache agrees with the pool and the holders: the eviction queue holds exactly
    the cached-free blocks; the hash index and the blocks' hashes agree both ways; a running
    request's cached blocks lie in its cached prefix (planned K/V), each at the position whose
    hash in its own chain is the block's; a shared block is cached. ``shared``: the shared
    blocks, as ``audit_pool`` returned them (found again when not given)."""
    allocator = scheduler.allocator
    cached = allocator.cached_blocks
    index = allocator.hash_index
    counts = allocator.ref_counts
    evictable = set(allocator.eviction_queue)
    # Set differences against the 100k-entry views would copy them: test membership instead.
    stray = set(filterfalse(cached.__contains__, evictable))
    if stray:
        raise InvariantViolation(f"block {min(stray)} is in the eviction queue but not cached")
    # The pool's three states are disjoint (audit_pool): a cached block that is free but not
    # queued can only be on the uncached list.
    uncached = allocator.uncached_free_blocks
    if not cached.keys().isdisjoint(uncached):
        block = min(b for b in uncached if b in cached)
        raise InvariantViolation(f"block {block} is cached and free but not in the eviction queue")
    if list(map(cached.get, index.values())) != list(index.keys()):  # in C: ~100k entries
        block = next(b for digest, b in index.items() if cached.get(b) != digest)
        raise InvariantViolation(f"the hash index names block {block} for another hash")
    if len(index) != len(cached):
        missing = min(b for b, digest in cached.items() if index.get(digest) != b)
        raise InvariantViolation(f"block {missing} is cached but not in the hash index")
    if shared is None:
        shared = shared_blocks(counts) if sum(counts.values()) != len(counts) else set()
    if shared:
        unhashed = [block for block in shared if block not in cached]
        if unhashed:
            block = min(unhashed)
            raise InvariantViolation(
                f"block {block} is shared by {counts[block]} requests but not cached"
            )
    for request in scheduler.running:
        _check_cached_prefix(request, cached, allocator.block_size)


def _check_cached_prefix(request: Request, cached: Mapping[int, bytes], block_size: int) -> None:
    """A holder's cached blocks lie in its first ``num_blocks_cached`` blocks, each with the
    hash its own chain gives that position. Chains hash every earlier token, so a block shared
    by two holders (it is cached, above) sits at the same position in both."""
    name, prefix = request.request_id, request.num_blocks_cached
    if prefix * block_size > request.num_computed or prefix > len(request.block_hashes):
        raise InvariantViolation(
            f"request {name} has {prefix} blocks in the cache but has computed only "
            f"{request.num_computed} tokens ({len(request.block_hashes)} hashed)"
        )
    tail = request.block_ids[prefix:]
    if not cached.keys().isdisjoint(tail):
        block = next(b for b in tail if b in cached)
        raise InvariantViolation(
            f"request {name} holds cached block {block} past its cached prefix of {prefix} blocks"
        )
    head = request.block_ids[:prefix]
    digests = list(map(cached.get, head))
    expected = request.block_hashes[:prefix]
    # Blocks whose hash another block already held stay uncached inside the prefix: compare the
    # cached ones only (compress and filter run in C: this loop covers the whole pool).
    if digests == expected or list(filter(None, digests)) == list(compress(expected, digests)):
        return
    for position, (digest, own) in enumerate(zip(digests, expected, strict=True)):
        if digest is not None and digest != own:
            raise InvariantViolation(
                f"request {name} holds cached block {head[position]} at position {position}, "
                "where its own hash chain names other tokens"
            )
