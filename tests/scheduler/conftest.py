"""Shared helpers for the scheduler tests: engines on the model-free SimWorker, which keeps its
cache rows under the same contract as the real worker (tokens hash the cached text)."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sim_worker import SimWorker

GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


def make_engine(
    num_blocks: int = 10,
    block_size: int = 4,
    num_slots: int = 3,
    token_budget: int = 64,
    watermark_blocks: int | None = 0,
    audit: bool = True,
    eos_token_ids: tuple[int, ...] = (),
    allocator: BlockAllocator | None = None,
    max_model_len: int = 4096,
    overlap: bool = True,
    vocab_size: int = 1000,
    prefix_caching: bool = True,
) -> Engine:
    """An audited engine on a fresh SimWorker."""
    worker = SimWorker(
        num_blocks,
        block_size,
        num_slots,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
    )
    config = SchedulerConfig(
        token_budget=token_budget,
        watermark_blocks=watermark_blocks,
        audit=audit,
        overlap=overlap,
        enable_prefix_caching=prefix_caching,
    )
    return Engine.for_worker(worker, config, allocator=allocator)


def prompts(n: int, length: int = 6) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` tokens."""
    return [[(7 * i + j) % 997 for j in range(length)] for i in range(n)]


def run_to_end(engine: Engine, max_steps: int = 10_000) -> int:
    """Step until nothing is unfinished; return the number of steps."""
    for n in range(1, max_steps + 1):
        engine.step()
        if not engine.has_unfinished():
            return n
    raise AssertionError("engine did not finish")


def assert_all_back(engine: Engine) -> None:
    """Every block free, every slot free, every worker row empty (after the releases land)."""
    engine.drain()
    step = engine.plan()  # the releases still pending
    if step is not None:
        engine.apply(engine.worker.execute(step))
    sched = engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert sched.slots.free == list(range(sched.num_slots))
    assert all(
        r.request_id is None and not r.block_ids and r.num_cached == 0 for r in engine.worker.rows()
    )
    engine.audit(engine.worker.rows())


@pytest.fixture
def engine() -> Engine:
    return make_engine()
