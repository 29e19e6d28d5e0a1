"""The pool as the web page receives it: the scheduler's bytes and rows, turned into runs by a
frontend, decode back to exactly the ledger. The snapshot carries the worker's plan and its own
pacing, appended to the wire format without moving what older peers read."""

from __future__ import annotations

import msgspec
import pytest

from frontend.page_feed import page_view
from frontend.pool_runs import decode_runs, pool_runs
from protocol.messages import SamplingParams
from protocol.monitor import (
    CACHED,
    FREE,
    HELD,
    MAX_WAITING_ROWS,
    SHARED,
    Cadence,
    Health,
    PoolRuns,
    PoolSnapshot,
    PoolStates,
    RequestRow,
)
from scheduler.engine import Engine
from scheduler.snapshot import pool_states, request_rows
from tests.scheduler.conftest import make_engine

PREFIX = [5, 6, 7, 8] * 3  # three full blocks of 4, shared by every request below


def ledger(engine: Engine) -> list[tuple[int, tuple[int, ...]]]:
    """``[(state, holders)]`` per block, read block by block from the allocator and requests."""
    sched = engine.scheduler
    allocator = sched.allocator
    cached_free = set(allocator.eviction_queue)
    expected = []
    for block in range(allocator.num_blocks):
        holders = tuple(i for i, r in enumerate(sched.running) if block in r.block_ids)
        count = allocator.ref_count(block)
        assert count == len(holders)
        if count > 1:
            expected.append((SHARED, holders))
        elif count == 1:
            expected.append((HELD, holders))
        else:
            expected.append((CACHED if block in cached_free else FREE, ()))
    return expected


def snapshot(engine: Engine) -> PoolRuns:
    """What a page gets: the scheduler's snapshot of the pool, turned into runs."""
    sched = engine.scheduler
    rows = request_rows(sched.running, sched.waiting, now=1e9)
    return pool_runs(pool_states(sched.allocator, sched.watermark_blocks), rows)


def test_a_pool_with_shared_and_cached_blocks_decodes_to_the_ledger():
    engine = make_engine(num_blocks=40, block_size=4, num_slots=4, token_budget=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("first", PREFIX + [1, 2], params)
    engine.step()  # its prefix blocks join the index: the next ones hit them
    for i in range(3):
        engine.add_request(f"r{i}", PREFIX + [20 + i] * (3 + i), params)
    engine.add_request("short", [9] * 9, SamplingParams(max_tokens=1, ignore_eos=True))
    seen = set()
    while engine.has_unfinished():
        engine.step()
        pool = snapshot(engine)
        assert decode_runs(pool) == ledger(engine)
        seen.update(state for state, _ in decode_runs(pool))
        assert len(pool.runs) // 3 < pool.num_blocks // 2, "runs, not one entry per block"
    assert seen == {FREE, CACHED, HELD, SHARED}


def test_a_mostly_cached_pool_decodes_to_the_ledger():
    """Cached-free blocks outnumber uncached ones."""
    engine = make_engine(num_blocks=12, block_size=4, num_slots=2)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(5):  # each leaves its two full blocks cached-free
        engine.add_request(f"done{i}", [30 + i] * 8 + [1], once)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("hit", [30] * 8 + [2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    pool = snapshot(engine)
    states = [state for state, _ in decode_runs(pool)]
    assert states.count(CACHED) > states.count(FREE) and HELD in states
    assert decode_runs(pool) == ledger(engine)


def test_the_snapshot_survives_the_wire():
    engine = make_engine(num_blocks=24, block_size=4, num_slots=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", PREFIX + [1], params)
    engine.step()
    engine.add_request("b", PREFIX + [2], params)
    engine.add_request("c", [3] * 5, params)
    engine.step()
    sched = engine.scheduler
    message = PoolSnapshot(
        pool=pool_states(sched.allocator, sched.watermark_blocks),
        requests=request_rows(sched.running, sched.waiting, now=1e9),
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=PoolSnapshot)
    assert len(decoded.pool.states) == 24  # one byte per block on the wire
    runs = pool_runs(decoded.pool, decoded.requests)
    assert decode_runs(runs) == ledger(engine)
    assert [(r.request_id, r.running) for r in decoded.requests] == [
        ("a", True),
        ("b", True),
        ("c", False),
    ]
    a, _, c = decoded.requests
    assert a.slot == 0 and a.num_blocks == 4 and a.num_prompt_tokens == 13
    assert c.slot is None and c.num_blocks == 0 and c.num_computed == 0
    assert a.blocks == sched.running[0].block_ids and c.blocks == []
    assert runs.owner_sets[:3] == [[], [0], [1]]  # empty, then each running request


def test_waiting_rows_are_capped_and_show_no_text():
    engine = make_engine(num_blocks=10, block_size=4, num_slots=1)
    for i in range(MAX_WAITING_ROWS + 5):
        engine.add_request(f"w{i}", [1, 2, 3], SamplingParams(max_tokens=2))
    rows = request_rows([], engine.scheduler.waiting, now=1e9)
    assert len(rows) == MAX_WAITING_ROWS
    assert all(not r.running and r.age_s > 0 for r in rows)
    names = {f.name for f in msgspec.structs.fields(RequestRow)}
    assert not any("ids" in name or "text" in name for name in names), names


def test_decode_refuses_runs_that_do_not_cover_the_pool():
    pool = PoolRuns(
        num_blocks=5, block_size=4, watermark_blocks=0, runs=[FREE, 0, 4], owner_sets=[[]]
    )
    with pytest.raises(ValueError, match="cover 4 blocks of 5"):
        decode_runs(pool)


def _row(name: str, blocks: list[int]) -> RequestRow:
    return RequestRow(
        request_id=name, running=True, slot=0, num_blocks=len(blocks), num_computed=0,
        num_prompt_tokens=1, num_output_tokens=0, max_tokens=1, num_preemptions=0, age_s=0.0,
        blocks=blocks,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("states", "blocks", "message"),
    [
        (bytes([FREE, HELD]), [1], "2 state bytes for 3 blocks"),
        (bytes([FREE, HELD, 7]), [1], "or a bad one"),
        (bytes([FREE, HELD, HELD]), [1], "block 2 is held but nobody holds it"),
        (bytes([FREE, SHARED, FREE]), [1, 5], "out of range 0..2"),
    ],
)
def test_a_pool_that_does_not_add_up_is_refused(states: bytes, blocks: list[int], message: str):
    pool = PoolStates(num_blocks=3, block_size=4, watermark_blocks=0, states=states)
    with pytest.raises(ValueError, match=message):
        pool_runs(pool, [_row("a", blocks)])


PLAN = {"attention": "sdpa", "linears": "int8", "dtype": "bfloat16", "threads": "2"}


def _health(**changes) -> Health:
    fields = dict(
        worker="ready", reason="", model_id="m", device="cpu", dtype="bfloat16",
        workers_lost_total=0, frontends_lost_total=0, num_steps_total=3, steps_in_flight=1,
        num_preemptions_total=0, audit=None, uptime_s=2.0, monitor_s_total=0.001,
    )  # fmt: skip
    return Health(**{**fields, **changes})


def test_the_worker_plan_and_the_cadence_reach_the_page():
    cadence = Cadence(interval_s=0.25, max_gap_s=1.0, budget=0.03, gap_s=1.0, throttled=True)
    message = PoolSnapshot(seq=7, health=_health(plan=PLAN), cadence=cadence)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=PoolSnapshot)
    assert decoded.health.plan == PLAN and decoded.cadence == cadence
    view = page_view(decoded)
    assert view["health"]["plan"] == PLAN
    assert view["cadence"] == {
        "interval_s": 0.25, "max_gap_s": 1.0, "budget": 0.03, "gap_s": 1.0, "throttled": True
    }  # fmt: skip


def test_a_snapshot_from_an_older_scheduler_decodes_without_plan_or_cadence():
    """Fields are appended, never reordered: a snapshot without the last ones still decodes."""
    message = PoolSnapshot(seq=7, health=_health(plan=PLAN), cadence=None)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(message))  # plain lists (array_like)
    *older, cadence = raw
    *older_health, plan = older[-2]
    assert cadence is None and plan == PLAN
    older[-2] = older_health
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(older), type=PoolSnapshot)
    assert decoded.seq == 7 and decoded.health.plan == {} and decoded.cadence is None
    assert decoded.health.monitor_s_total == 0.001  # the field before plan kept its place


def test_the_snapshot_fields_keep_their_order():
    """What older frontends decode by position (``array_like``): only appended to."""
    assert PoolSnapshot.__struct_fields__ == (
        "protocol_version", "seq", "time", "pool", "requests", "num_running", "num_waiting",
        "health", "events", "cadence",
    )  # fmt: skip
    assert Health.__struct_fields__[-3:] == ("uptime_s", "monitor_s_total", "plan")
    with pytest.raises(TypeError):
        Cadence(0.25, 1.0, 0.03, 0.0, False)  # keyword-only, as every part
