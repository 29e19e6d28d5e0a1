"""The worker's cache rows against the slot ledger: the row half of the audit.

A slot freed by a finish or an abort reaches the worker with the NEXT StepInput
(``released_slots``), so between iterations its row may still show the last tenant: that is not
a slack. ``audit_rows`` audits the rows as they will be once those pending releases apply, and
checks the pending list itself: every pending slot must be free in the slot ledger, and the stale
tenant must be gone from the scheduler with none of its row's blocks held by anyone (except a
cached block, which is shared read-only). A slot that is free but not pending must have an empty
row, with no tolerance at all. A held row may be one block behind its tenant (the audit's second
named slack), and its K/V count is exactly what the tenant has computed.
"""

from __future__ import annotations

from protocol.messages import RowSummary, StepInput
from scheduler.errors import InvariantViolation
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def project_rows(rows: list[RowSummary], steps: list[StepInput]) -> list[RowSummary]:
    """The rows as they will be after ``steps`` run, in order, under the row contract: released
    slots empty first, then rewinds cut rows back, then each item begins (fresh) or extends its
    slot's row."""
    by_slot = {row.slot: row for row in rows}
    for step in steps:
        for slot in step.released_slots:
            by_slot[slot] = RowSummary(slot=slot, request_id=None, block_ids=[], num_cached=0)
        for rewind in step.rewinds:
            row = by_slot[rewind.slot]
            by_slot[rewind.slot] = RowSummary(
                slot=rewind.slot,
                request_id=row.request_id,
                block_ids=row.block_ids[: rewind.num_blocks],
                num_cached=min(row.num_cached, rewind.num_cached),
            )
        for item in step.items:
            row = by_slot.get(item.slot)
            if item.fresh or row is None:
                blocks, cached = [], 0
            else:
                blocks, cached = row.block_ids, row.num_cached
            by_slot[item.slot] = RowSummary(
                slot=item.slot,
                request_id=item.request_id,
                block_ids=[*blocks, *item.new_blocks],
                num_cached=(item.start if item.fresh else cached) + len(item.token_ids),
            )
    return [by_slot[slot] for slot in sorted(by_slot)]


def audit_rows(scheduler: Scheduler, rows: list[RowSummary]) -> None:
    """The worker's cache rows agree with the slot ledger: a free slot's row is empty (once any
    pending release applies), a held row's blocks are a prefix of its tenant's blocks at most
    one block behind (slack 2), and its K/V count is exactly what the tenant has computed."""
    by_slot: dict[int, RowSummary] = {}
    for row in rows:
        if row.slot in by_slot:
            raise InvariantViolation(f"slot {row.slot} has two rows")
        by_slot[row.slot] = row
    missing = set(range(scheduler.num_slots)) - by_slot.keys()
    if missing:
        raise InvariantViolation(f"slot {min(missing)} has no row in the worker's summary")
    owners = {r.slot: r for r in scheduler.running}
    pending = set(scheduler.slots.pending_releases)
    for slot, row in sorted(by_slot.items()):
        if slot in pending:
            _check_stale_row(scheduler, row)
        elif slot in owners and owners[slot].reattached:
            _check_kept_row(scheduler, row, owners[slot])
        elif slot in owners:
            _check_held_row(scheduler, row, owners[slot])
        elif row.request_id is not None or row.block_ids or row.num_cached:
            raise InvariantViolation(
                f"slot {slot} is free but its row holds request {row.request_id} "
                f"({len(row.block_ids)} blocks, {row.num_cached} tokens)"
            )


def _check_stale_row(scheduler: Scheduler, row: RowSummary) -> None:
    if row.request_id is not None and scheduler.get(row.request_id) is not None:
        raise InvariantViolation(
            f"slot {row.slot} awaits release but its row's tenant {row.request_id} is still known"
        )
    held = {b: r.request_id for r in scheduler.running for b in r.block_ids}
    cached = scheduler.allocator.cached_blocks
    for block in row.block_ids:
        if block in held and block not in cached:  # a cached block may be shared, read-only
            raise InvariantViolation(
                f"slot {row.slot} awaits release but its row's block {block} is held by "
                f"request {held[block]}"
            )


def _check_kept_row(scheduler: Scheduler, row: RowSummary, owner: Request) -> None:
    """A request kept across a worker's death (``Request.rollback``) whose row the new worker
    has not begun: the row is empty (the K/V is the shared pool's, not a row's), and its blocks
    cover what it computed, with nothing pending."""
    name = owner.request_id
    if row.request_id is not None or row.block_ids or row.num_cached:
        raise InvariantViolation(
            f"slot {row.slot} of request {name}, kept across a re-attach, already has a row "
            f"({row.request_id}, {len(row.block_ids)} blocks, {row.num_cached} tokens)"
        )
    size = scheduler.allocator.block_size
    if owner.num_pending or len(owner.block_ids) * size < owner.num_computed:
        raise InvariantViolation(
            f"request {name}, kept across a re-attach, has {owner.num_pending} pending tokens "
            f"and {len(owner.block_ids)} blocks for {owner.num_computed} computed tokens"
        )


def _check_held_row(scheduler: Scheduler, row: RowSummary, owner: Request) -> None:
    name, slot = owner.request_id, row.slot
    if row.request_id != name:
        raise InvariantViolation(
            f"slot {slot} belongs to {name} but its row holds {row.request_id}"
        )
    blocks = owner.block_ids
    if row.block_ids != blocks[: len(row.block_ids)]:
        raise InvariantViolation(
            f"row of slot {slot} addresses blocks {row.block_ids}, not a prefix of request "
            f"{name}'s blocks {blocks}"
        )
    if len(row.block_ids) < len(blocks) - 1:
        raise InvariantViolation(
            f"row of slot {slot} has {len(row.block_ids)} blocks, more than one behind request "
            f"{name}'s {len(blocks)}"
        )
    if row.num_cached != owner.num_computed:
        raise InvariantViolation(
            f"row of slot {slot} holds K/V for {row.num_cached} tokens but request {name} has "
            f"computed {owner.num_computed}"
        )
    if row.num_cached > len(row.block_ids) * scheduler.allocator.block_size:
        raise InvariantViolation(
            f"row of slot {slot} holds {row.num_cached} tokens in only {len(row.block_ids)} blocks"
        )
