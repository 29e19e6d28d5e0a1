"""Sizing: the ledgers a worker's announcement calls for, and moving requests to a new pool.

The worker's cache geometry (block size, slots, context length, end-of-sequence ids, vocabulary)
sizes the scheduler; ``SchedulerConfig`` may only shrink what the worker offers. A worker that
replaces a lost one takes over its requests when it shares that geometry (``geometry``), but not
necessarily the pool's size: a default pool is sized from free memory, which differs between
starts, so the requests move to the new pool (``move_to_pool``).
"""

from __future__ import annotations

from protocol.messages import RequestOutput, WorkerReady
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler


def geometry(ready: WorkerReady) -> tuple:
    """What a replacement worker must share with the lost one for requests to carry over. Not
    the pool's size (``move_to_pool``)."""
    return (
        ready.model_id,
        ready.block_size,
        ready.num_slots,
        ready.max_model_len,
        tuple(ready.eos_token_ids),
        ready.vocab_size,
    )


def build_scheduler(
    ready: WorkerReady, config: SchedulerConfig, allocator: BlockAllocator | None = None
) -> Scheduler:
    """A scheduler with empty queues, sized to the worker; ValueError if the config or the
    given ``allocator`` asks for more than the worker has."""
    if config.num_slots is not None and config.num_slots > ready.num_slots:
        raise ValueError(f"num_slots {config.num_slots} > the worker's {ready.num_slots}")
    if config.num_blocks is not None and config.num_blocks > ready.num_blocks:
        raise ValueError(f"num_blocks {config.num_blocks} > the worker's {ready.num_blocks}")
    if allocator is None:
        allocator = BlockAllocator(config.num_blocks or ready.num_blocks, ready.block_size)
    if allocator.num_blocks > ready.num_blocks or allocator.block_size != ready.block_size:
        raise ValueError("the allocator's geometry does not fit the worker's cache")
    return Scheduler(
        allocator,
        num_slots=config.num_slots or ready.num_slots,
        token_budget=config.token_budget,
        watermark_blocks=config.watermark_blocks,
        max_model_len=min(config.max_model_len or ready.max_model_len, ready.max_model_len),
        eos_token_ids=tuple(ready.eos_token_ids),
        prefix_caching=config.enable_prefix_caching,
        speculative_tokens=config.speculative_tokens,
        speculative_max_running=config.speculative_max_running,
    )


def move_to_pool(
    scheduler: Scheduler, ready: WorkerReady, config: SchedulerConfig
) -> list[RequestOutput]:
    """Move a scheduler with nothing running to the pool of ``ready`` (same geometry, another
    size): the waiting requests it can hold move, those it cannot end with an error
    (returned)."""
    limit = config.num_blocks
    allocator = BlockAllocator(min(limit or ready.num_blocks, ready.num_blocks), ready.block_size)
    reserve = config.watermark_blocks
    reserve = int(0.01 * allocator.num_blocks) if reserve is None else reserve
    failed = []
    for request in list(scheduler.waiting):
        most = request.most_blocks(allocator.block_size, scheduler.max_model_len)
        if most > allocator.num_blocks:
            scheduler.abort(request.request_id)
            failed.append(request.request_id)
    scheduler.replace_pool(allocator, min(reserve, allocator.num_blocks))
    why = f"the new worker's pool of {allocator.num_blocks} blocks cannot hold this request"
    return [
        RequestOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=why)
        for rid in failed
    ]
