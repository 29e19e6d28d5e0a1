"""The engine's invariants written down as code, checked between iterations.

Observation point: these checks hold for a settled engine, after a step's results are applied
and before the next schedule(). Exactly two carry slack, both for work really in flight:

1. a running request's blocks must cover ``num_tokens - 1``: between a sample and the next
   schedule it holds one token (the sampled one) more than its blocks need to cache. With
   speculative decoding, while a step verifying its ``num_draft`` draft tokens is in flight,
   it may hold blocks (and K/V) for up to ``num_draft`` tokens more: at most ``k + 1`` tokens
   past what it knows, ``k`` its draft limit (``Speculation.limit``). Once the verification is
   applied the bound is the exact one again: rejected drafts' blocks are back in the pool, and
   a pending ``Rewind`` cuts its row to exactly its blocks and computed tokens;
2. a cache row may be one block behind its request: the scheduler grows a request at the top
   of an iteration and the row learns of the new block with the step that writes into it
   (``scheduler.audit_rows``).

The pool ledger has no slack, which is why it is the check that finds things. With prefix
caching it says "reference count equals the number of holders" and the three block states
(held, cached-free, uncached-free) partition the pool; ``audit_cache`` (``scheduler.audit_cache``)
checks the index against the pool and the holders both ways.

Overlap adds no slack either. The ledgers advance when a step is planned, so with a step in
flight they describe the state after it; the worker's rows (reported after the last applied
step) are brought to the same point by ``project_rows``, which applies the in-flight steps to
them exactly as the worker will. Every check then runs unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from protocol.messages import RowSummary
from scheduler.audit_cache import audit_cache, shared_blocks
from scheduler.audit_rows import audit_rows, project_rows
from scheduler.audit_states import audit_block_states
from scheduler.errors import InvariantViolation
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler


def audit_all(scheduler: Scheduler, rows: list[RowSummary] | None = None) -> None:
    """Run every check; ``rows`` (the worker's cache rows) are checked when given."""
    shared = audit_pool(scheduler)
    audit_cache(scheduler, shared)
    audit_slots(scheduler)
    audit_requests(scheduler)
    audit_block_states(scheduler, shared)  # last: the ledger itself is checked by then
    if rows is not None:
        audit_rows(scheduler, rows)


def _known(scheduler: Scheduler) -> list[Request]:
    return list(scheduler.waiting) + list(scheduler.running)


def audit_pool(scheduler: Scheduler) -> set[int]:
    """Every block is uncached-free, cached-free or held (exactly one of them), and a held
    block's reference count equals the number of requests holding it (no holder means a leak).
    Returns the shared blocks (several holders), which ``audit_cache`` checks further."""
    allocator = scheduler.allocator
    uncached = allocator.uncached_free_blocks
    evictable = frozenset(allocator.eviction_queue)
    counts = allocator.ref_counts
    known = _known(scheduler)
    # Set arithmetic first (fast at 100k blocks); per-block detail only to name a culprit.
    held: set[int] = set()
    holdings = 0
    for request in known:
        held.update(request.block_ids)
        holdings += len(request.block_ids)
    for first, second, what in (
        (uncached, counts.keys(), "both free and allocated"),
        (evictable, counts.keys(), "both cached-free and allocated"),
        (uncached, evictable, "both uncached-free and cached-free"),
    ):
        both = first & second
        if both:
            raise InvariantViolation(f"block {min(both)} is {what}")
    free = uncached | evictable
    if len(free) + len(counts) != allocator.num_blocks or allocator.num_free != len(free):
        lost = set(range(allocator.num_blocks)) - free - counts.keys()
        raise InvariantViolation(f"block {min(lost)} is neither free nor allocated")
    if not held <= counts.keys():  # a held block is free, out of range, or nowhere
        _raise_unallocated(known, held - counts.keys(), free, allocator.num_blocks)
    if len(counts) != len(held):  # held is inside allocated now: only a size check is left
        leaked = counts.keys() - held
        raise InvariantViolation(f"block {min(leaked)} is allocated but no request holds it")
    total = sum(counts.values())
    if holdings != total or total != len(counts):  # a mismatch, or a shared block
        return _check_reference_counts(known, counts, holdings == total)
    return set()


def _check_reference_counts(
    known: list[Request], counts: Mapping[int, int], as_many: bool
) -> set[int]:
    """Every block's reference count equals its holders. With as many holdings as the counts
    add up to (``as_many``), checking the shared blocks is enough: each other block is held at
    least once and counts one, so a block held twice would leave some shared block short."""
    holders: Counter[int] = Counter()
    if as_many:
        suspects = shared_blocks(counts)
        for request in known:  # in C per request: the shared blocks are few
            holders.update(suspects.intersection(request.block_ids))
    else:
        holders.update(block for request in known for block in request.block_ids)
        suspects = holders.keys() | counts.keys()
    for block in sorted(suspects):
        if counts.get(block, 0) != holders[block]:
            names = [r.request_id for r in known if block in r.block_ids]
            raise InvariantViolation(
                f"block {block} has reference count {counts.get(block, 0)} but {len(names)} "
                f"holders ({', '.join(names)})"
            )
    return suspects


def _raise_unallocated(known: list[Request], blocks: set[int], free, num_blocks: int) -> None:
    """Name the request holding a block that is not allocated, and what the block is."""
    block = min(blocks)
    holder = next(r.request_id for r in known if block in r.block_ids)
    if not 0 <= block < num_blocks:
        raise InvariantViolation(
            f"request {holder} holds block {block}, out of range 0..{num_blocks - 1}"
        )
    if block in free:
        raise InvariantViolation(f"block {block} is free but request {holder} holds it")
    raise InvariantViolation(f"block {block} is neither free nor allocated")


def audit_slots(scheduler: Scheduler) -> None:
    """Every slot is free or held by exactly one running request, never both, never neither;
    every slot awaiting release is free."""
    free = scheduler.slots.free
    dupes = [slot for slot, n in Counter(free).items() if n > 1]
    if dupes:
        raise InvariantViolation(f"slot {dupes[0]} is listed free {Counter(free)[dupes[0]]} times")
    holders: dict[int, str] = {}
    for request in scheduler.running:
        slot = request.slot
        if slot is None:
            raise InvariantViolation(f"request {request.request_id} is running without a slot")
        if not 0 <= slot < scheduler.num_slots:
            raise InvariantViolation(
                f"request {request.request_id} holds slot {slot}, out of range "
                f"0..{scheduler.num_slots - 1}"
            )
        if slot in holders:
            raise InvariantViolation(
                f"slot {slot} is held by both {holders[slot]} and {request.request_id}"
            )
        holders[slot] = request.request_id
    free_set = set(free)
    for slot in range(scheduler.num_slots):
        if slot in free_set and slot in holders:
            raise InvariantViolation(f"slot {slot} is free but request {holders[slot]} holds it")
        if slot not in free_set and slot not in holders:
            raise InvariantViolation(f"slot {slot} is neither free nor held by a request")
    stray = free_set - set(range(scheduler.num_slots))
    if stray:
        raise InvariantViolation(f"slot {min(stray)} is listed free but out of range")
    for slot in scheduler.slots.pending_releases:
        if slot not in free_set:
            raise InvariantViolation(f"slot {slot} awaits release but is not free")


def audit_requests(scheduler: Scheduler) -> None:
    """A waiting request holds nothing; a running one holds a slot and exactly the blocks its
    tokens need (slack 1); both queues are in arrival order, nothing waiting older than anything
    running; the id index matches the queues."""
    blocks_for = scheduler.allocator.blocks_for_length
    for request in scheduler.waiting:
        _check_waiting(request)
    for request in scheduler.running:
        if request.status is not RequestStatus.RUNNING:
            raise InvariantViolation(
                f"request {request.request_id} is in the running list with status "
                f"{request.status.value}"
            )
        n, held, drafts = request.num_tokens, len(request.block_ids), request.num_draft
        _check_drafts(scheduler, request)
        if not blocks_for(n - 1) <= held <= blocks_for(n + drafts):
            raise InvariantViolation(
                f"request {request.request_id} holds {held} blocks for {n} tokens"
                f"{_and_drafts(drafts)} (needs {blocks_for(n - 1)} to {blocks_for(n + drafts)})"
            )
        if not request.num_computed < n + drafts:
            raise InvariantViolation(
                f"request {request.request_id} has computed {request.num_computed} of {n} tokens"
                f"{_and_drafts(drafts)} (the last sampled token is never computed before the "
                "next step)"
            )
    _check_rewinds(scheduler)
    _check_order(scheduler)


def _and_drafts(drafts: int) -> str:
    return f" and {drafts} drafts in flight" if drafts else ""


def _check_drafts(scheduler: Scheduler, request: Request) -> None:
    """Drafts in flight: within the request's limit, with the token their verification
    brings pending, and at most one more (a plain decode planned before them)."""
    drafts, name = request.num_draft, request.request_id
    if not drafts:
        return
    limit = scheduler.speculation.limit(request)
    if drafts > limit:
        raise InvariantViolation(
            f"request {name} has {drafts} drafts in flight, more than its limit {limit}"
        )
    if not 1 <= request.num_pending <= 2:
        raise InvariantViolation(
            f"request {name} has {drafts} drafts in flight with {request.num_pending} pending "
            "tokens (its verification's, and at most a plain decode's before it)"
        )


def _check_rewinds(scheduler: Scheduler) -> None:
    """Each pending rewind cuts a running request's row to exactly its blocks and its
    computed tokens (a rewind of a slot no request holds, or one that keeps a rejected draft's
    block or K/V, is wrong)."""
    owners = {r.slot: r for r in scheduler.running}
    for rewind in scheduler.pending_rewinds:
        owner = owners.get(rewind.slot)
        if owner is None:
            raise InvariantViolation(f"a rewind of slot {rewind.slot}, which no request holds")
        if (rewind.num_blocks, rewind.num_cached) != (
            len(owner.block_ids),
            owner.num_computed,
        ):
            raise InvariantViolation(
                f"the rewind of slot {rewind.slot} keeps {rewind.num_blocks} blocks and "
                f"{rewind.num_cached} tokens, but request {owner.request_id} holds "
                f"{len(owner.block_ids)} blocks and has computed {owner.num_computed}"
            )


def _check_waiting(request: Request) -> None:
    name = request.request_id
    if request.status is not RequestStatus.WAITING:
        raise InvariantViolation(f"request {name} is waiting with status {request.status.value}")
    if request.slot is not None:
        raise InvariantViolation(f"request {name} is waiting but holds slot {request.slot}")
    if request.block_ids:
        raise InvariantViolation(f"request {name} is waiting but holds blocks {request.block_ids}")
    if request.num_computed:
        raise InvariantViolation(f"request {name} is waiting with {request.num_computed} computed")
    if request.num_draft:
        raise InvariantViolation(f"request {name} is waiting with {request.num_draft} drafts")


def _check_order(scheduler: Scheduler) -> None:
    for queue_name, queue in (("waiting", list(scheduler.waiting)), ("running", scheduler.running)):
        for before, after in zip(queue, queue[1:], strict=False):
            if before.arrival >= after.arrival:
                raise InvariantViolation(
                    f"{queue_name} queue out of arrival order: request {before.request_id} "
                    f"(arrival {before.arrival}) before request {after.request_id} "
                    f"(arrival {after.arrival})"
                )
    if scheduler.waiting and scheduler.running:
        head, newest = scheduler.waiting[0], scheduler.running[-1]
        if head.arrival < newest.arrival:
            raise InvariantViolation(
                f"request {head.request_id} (arrival {head.arrival}) is waiting but request "
                f"{newest.request_id} (arrival {newest.arrival}) arrived later and is running"
            )
    ids = [r.request_id for r in _known(scheduler)]
    if len(ids) != len(set(ids)) or set(ids) != scheduler.known_ids:
        extra = sorted(set(ids) ^ scheduler.known_ids) or [
            i for i, n in Counter(ids).items() if n > 1
        ]
        raise InvariantViolation(f"request {extra[0]} is not in exactly one queue and the index")


__all__ = [
    "InvariantViolation",
    "audit_all",
    "audit_block_states",
    "audit_cache",
    "audit_pool",
    "audit_requests",
    "audit_rows",
    "audit_slots",
    "project_rows",
]
