"""Every audit check fires: each test corrupts exactly one thing and asserts on the message."""

from __future__ import annotations

import heapq

import pytest

from protocol.messages import RowSummary, SamplingParams
from scheduler.audit import (
    InvariantViolation,
    audit_all,
    audit_pool,
    audit_requests,
    audit_rows,
    audit_slots,
)
from scheduler.engine import Engine
from tests.scheduler.conftest import make_engine, prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def eng() -> Engine:
    """Three running (slots 0..2), two waiting, settled between iterations; audit is clean."""
    engine = make_engine(num_blocks=32, num_slots=3, overlap=False)
    for i, p in enumerate(prompts(5, length=6)):
        engine.add_request(f"r{i}", p, PARAMS)
    for _ in range(3):
        engine.step()
    engine.audit(engine.worker.rows())
    assert len(engine.scheduler.running) == 3 and len(engine.scheduler.waiting) == 2
    return engine


def run(check, engine: Engine, rows=None, match: str = "") -> None:
    with pytest.raises(InvariantViolation, match=match):
        if rows is None:
            check(engine.scheduler)
        else:
            check(engine.scheduler, rows)


# -- audit_pool ------------------------------------------------------------------------------
def test_pool_both_free_and_allocated(eng: Engine) -> None:
    block = eng.scheduler.running[0].block_ids[0]
    eng.scheduler.allocator._free_set.add(block)
    run(audit_pool, eng, match=f"block {block} is both free and allocated")


def test_pool_neither_free_nor_allocated(eng: Engine) -> None:
    alloc = eng.scheduler.allocator
    block = min(alloc._free_set)
    alloc._free_set.discard(block)
    run(audit_pool, eng, match=f"block {block} is neither free nor allocated")


def test_pool_free_but_held(eng: Engine) -> None:
    block = min(eng.scheduler.allocator.free_blocks)
    eng.scheduler.running[1].block_ids.append(block)
    run(audit_pool, eng, match=f"block {block} is free but request r1 holds it")


def test_pool_allocated_but_unheld(eng: Engine) -> None:
    block = eng.scheduler.running[2].block_ids.pop()
    run(audit_pool, eng, match=f"block {block} is allocated but no request holds it")


def test_pool_reference_count_differs_from_holders(eng: Engine) -> None:
    block = eng.scheduler.running[0].block_ids[0]
    eng.scheduler.running[1].block_ids.append(block)
    run(audit_pool, eng, match=f"block {block} has reference count 1 but 2 holders \\(r0, r1\\)")


def test_pool_block_out_of_range(eng: Engine) -> None:
    eng.scheduler.running[0].block_ids.append(99)
    run(audit_pool, eng, match="request r0 holds block 99, out of range 0..31")


# -- audit_slots -----------------------------------------------------------------------------
def test_slot_listed_free_twice() -> None:
    engine = make_engine(num_slots=3)
    heapq.heappush(engine.scheduler.slots._free, 1)
    run(audit_slots, engine, match="slot 1 is listed free 2 times")


def test_slot_running_without_slot(eng: Engine) -> None:
    eng.scheduler.running[1].slot = None
    run(audit_slots, eng, match="request r1 is running without a slot")


def test_slot_out_of_range(eng: Engine) -> None:
    eng.scheduler.running[1].slot = 7
    run(audit_slots, eng, match="request r1 holds slot 7, out of range 0..2")


def test_slot_held_twice(eng: Engine) -> None:
    eng.scheduler.running[2].slot = eng.scheduler.running[0].slot
    run(audit_slots, eng, match="slot 0 is held by both r0 and r2")


def test_slot_free_and_held(eng: Engine) -> None:
    heapq.heappush(eng.scheduler.slots._free, 2)
    run(audit_slots, eng, match="slot 2 is free but request r2 holds it")


def test_slot_neither_free_nor_held() -> None:
    engine = make_engine(num_slots=3)
    engine.scheduler.slots._free.remove(1)
    run(audit_slots, engine, match="slot 1 is neither free nor held")


def test_slot_free_out_of_range() -> None:
    engine = make_engine(num_slots=3)
    heapq.heappush(engine.scheduler.slots._free, 5)
    run(audit_slots, engine, match="slot 5 is listed free but out of range")


def test_slot_pending_release_not_free(eng: Engine) -> None:
    eng.scheduler.slots._pending.append(1)
    run(audit_slots, eng, match="slot 1 awaits release but is not free")


# -- audit_requests --------------------------------------------------------------------------
def test_waiting_request_holds_a_slot(eng: Engine) -> None:
    eng.scheduler.waiting[0].slot = 0
    run(audit_requests, eng, match="request r3 is waiting but holds slot 0")


def test_waiting_request_holds_blocks(eng: Engine) -> None:
    eng.scheduler.waiting[1].block_ids = [30]
    run(audit_requests, eng, match="request r4 is waiting but holds blocks \\[30\\]")


def test_waiting_request_has_computed_tokens(eng: Engine) -> None:
    eng.scheduler.waiting[0].num_computed = 3
    run(audit_requests, eng, match="request r3 is waiting with 3 computed")


def test_running_request_with_too_few_blocks(eng: Engine) -> None:
    request = eng.scheduler.running[0]  # 9 tokens, 8 computed: 2 blocks
    request.block_ids.pop()
    run(audit_requests, eng, match="request r0 holds 1 blocks for 9 tokens \\(needs 2 to 3\\)")


def test_running_request_with_an_extra_block(eng: Engine) -> None:
    eng.scheduler.running[0].block_ids += [30, 31]
    run(audit_requests, eng, match="request r0 holds 4 blocks for 9 tokens")


def test_running_request_computed_everything(eng: Engine) -> None:
    eng.scheduler.running[0].num_computed = 9
    run(audit_requests, eng, match="request r0 has computed 9 of 9 tokens")


def test_waiting_queue_out_of_order(eng: Engine) -> None:
    eng.scheduler.waiting.rotate()
    run(audit_requests, eng, match="waiting queue out of arrival order: request r4")


def test_running_queue_out_of_order(eng: Engine) -> None:
    eng.scheduler.running.reverse()
    run(audit_requests, eng, match="running queue out of arrival order: request r2")


def test_waiting_older_than_running(eng: Engine) -> None:
    sched = eng.scheduler
    sched.waiting[0].arrival, sched.waiting[1].arrival = -2, -1
    run(audit_requests, eng, match="request r3 \\(arrival -2\\) is waiting but request r2")


def test_request_missing_from_the_index(eng: Engine) -> None:
    del eng.scheduler._requests["r4"]
    run(audit_requests, eng, match="request r4 is not in exactly one queue")


def test_running_request_with_waiting_status(eng: Engine) -> None:
    from scheduler.request import RequestStatus

    eng.scheduler.running[1].status = RequestStatus.WAITING
    run(audit_requests, eng, match="request r1 is in the running list with status waiting")


# -- audit_rows ------------------------------------------------------------------------------
def _rows(eng: Engine, slot: int, **changes) -> list[RowSummary]:
    rows = eng.worker.rows()
    row = rows[slot]
    fields = dict(
        slot=row.slot, request_id=row.request_id, block_ids=row.block_ids, num_cached=row.num_cached
    )
    rows[slot] = RowSummary(**{**fields, **changes})
    return rows


def test_rows_two_for_one_slot(eng: Engine) -> None:
    rows = eng.worker.rows()
    run(audit_rows, eng, rows + [rows[1]], match="slot 1 has two rows")


def test_rows_missing_slot(eng: Engine) -> None:
    run(audit_rows, eng, eng.worker.rows()[:2], match="slot 2 has no row")


def test_rows_free_slot_not_empty() -> None:
    engine = make_engine(num_slots=2)
    rows = engine.worker.rows()
    rows[1] = RowSummary(slot=1, request_id=None, block_ids=[3], num_cached=0)
    run(audit_rows, engine, rows, match="slot 1 is free but its row holds request None \\(1 blocks")


def test_rows_wrong_tenant(eng: Engine) -> None:
    run(
        audit_rows,
        eng,
        _rows(eng, 1, request_id="r0"),
        match="slot 1 belongs to r1 but its row holds r0",
    )


def test_rows_not_a_prefix(eng: Engine) -> None:
    owner = eng.scheduler.running[1]
    wrong = [owner.block_ids[1], owner.block_ids[0]]
    run(audit_rows, eng, _rows(eng, 1, block_ids=wrong), match="row of slot 1 addresses blocks")


def test_rows_more_than_one_block_behind(eng: Engine) -> None:
    run(
        audit_rows,
        eng,
        _rows(eng, 1, block_ids=[]),
        match="row of slot 1 has 0 blocks, more than one behind request r1's 2",
    )


def test_rows_kv_count_differs(eng: Engine) -> None:
    run(
        audit_rows,
        eng,
        _rows(eng, 2, num_cached=6),
        match="row of slot 2 holds K/V for 6 tokens but request r2 has computed 8",
    )


def test_rows_kv_beyond_the_rows_blocks(eng: Engine) -> None:
    owner = eng.scheduler.running[0]  # 8 computed in 2 blocks of 4: one block cannot hold them
    run(
        audit_rows,
        eng,
        _rows(eng, 0, block_ids=owner.block_ids[:1]),
        match="row of slot 0 holds 8 tokens in only 1 blocks",
    )


def test_rows_one_block_behind_is_the_named_slack(eng: Engine) -> None:
    owner = eng.scheduler.running[0]
    owner.num_computed = 4  # as if the row had just been grown but not yet written
    owner.output_token_ids.pop()  # keep the request's own ledger consistent (n = 8)
    audit_rows(eng.scheduler, _rows(eng, 0, block_ids=owner.block_ids[:1], num_cached=4))


def test_rows_stale_tenant_still_known(eng: Engine) -> None:
    eng.scheduler.abort("r1")
    audit_all(eng.scheduler, eng.worker.rows())  # the pending release explains the stale row
    run(
        audit_rows,
        eng,
        _rows(eng, 1, request_id="r0"),
        match="slot 1 awaits release but its row's tenant r0 is still known",
    )


def test_rows_stale_block_held_by_someone_else() -> None:
    eng = make_engine(num_blocks=32, num_slots=3, overlap=False, prefix_caching=False)
    for i, p in enumerate(prompts(3, length=6)):
        eng.add_request(f"r{i}", p, PARAMS)
    for _ in range(3):
        eng.step()
    eng.scheduler.abort("r1")
    block = eng.scheduler.running[0].block_ids[0]
    run(
        audit_rows,
        eng,
        _rows(eng, 1, block_ids=[block]),
        match=f"slot 1 awaits release but its row's block {block} is held by request r0",
    )


def test_clean_state_passes_every_check(eng: Engine) -> None:
    audit_all(eng.scheduler, eng.worker.rows())
