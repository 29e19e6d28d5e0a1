"""The ledgers as the web page draws them: the pool as one byte per block, the queues as rows
(torch-free).

``pool_states`` copies the allocator's ``block_states`` (kept up to date by every change, and
audited), so a snapshot costs one copy of the pool however fragmented it is. ``request_rows``
lists the queues, counts and block ids only: no prompt text. Frontends turn the two into the
runs browsers draw (``frontend.pool_runs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.monitor import MAX_WAITING_ROWS, PoolStates, RequestRow
from scheduler.block_allocator import BlockAllocator
from scheduler.request import Request


def pool_states(allocator: BlockAllocator, watermark_blocks: int) -> PoolStates:
    """The pool as it stands, one byte per block (see ``BlockAllocator.block_states``)."""
    return PoolStates(
        num_blocks=allocator.num_blocks,
        block_size=allocator.block_size,
        watermark_blocks=watermark_blocks,
        states=bytes(allocator.block_states),
    )


def request_rows(
    running: Sequence[Request], waiting: Sequence[Request], now: float
) -> list[RequestRow]:
    """Every running request, then the head of the waiting queue (``MAX_WAITING_ROWS``)."""
    rows = [_row(request, True, now) for request in running]
    for position, request in enumerate(waiting):
        if position == MAX_WAITING_ROWS:
            break
        rows.append(_row(request, False, now))
    return rows


def _row(request: Request, running: bool, now: float) -> RequestRow:
    return RequestRow(
        request_id=request.request_id,
        running=running,
        slot=request.slot,
        num_blocks=len(request.block_ids),
        num_computed=request.num_computed,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_generated,
        max_tokens=request.params.max_tokens,
        num_preemptions=request.num_preemptions,
        age_s=round(now - request.arrival_time, 3),
        num_cached_tokens=request.num_cached_tokens or 0,
        blocks=list(request.block_ids),
    )
