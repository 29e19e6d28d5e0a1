"""Re-attach instead of recompute, without a model: the SimWorker's successor keeps its pool, so
a worker killed mid-run costs only the tokens of the steps in flight, the text is the same as an
undisturbed run, and every audit passes across the restart (``soak(kills=...)``). A pool that
cannot be taken over (another pool, a generation skipped, a private pool) falls back to
recompute, counted by reason."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import SamplingParams
from scheduler.audit import InvariantViolation
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.restarts import can_reattach, rank_mismatch
from scheduler.sim_worker import SimWorker
from scheduler.soak import make_prompts, soak

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CONFIG = SchedulerConfig(token_budget=16, watermark_blocks=0, audit=True)


def _engine(num_blocks: int = 64, overlap: bool = True) -> Engine:
    worker = SimWorker(num_blocks, 4, 4).shared()
    return Engine.for_worker(worker, msgspec_replace(CONFIG, overlap=overlap))


def msgspec_replace(config: SchedulerConfig, **changes: object) -> SchedulerConfig:
    from dataclasses import replace

    return replace(config, **changes)


def _run(engine: Engine, prompts: list[list[int]], kill_after: int | None, partial: bool):
    """Run ``prompts`` to the end, killing the worker after ``kill_after`` steps; returns the
    outputs by request and the tokens in flight at the kill."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps, in_flight = 0, 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        steps += 1
        if steps == kill_after:
            while engine.can_plan() and engine.plan() is not None:
                pass  # the worker dies with as many steps in flight as it may have
            in_flight = sum(len(i.token_ids) for s in engine.in_flight for i in s.items)
            if partial:
                engine.worker.execute(engine.in_flight[0])  # K/V written, never answered
            engine.worker_lost(keep=True)
            engine.worker = engine.worker.successor()
            assert engine.fit(engine.worker.ready()) == []
    engine.drain()
    return tokens, in_flight


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("kill_after", [1, 2, 5, 9])
def test_a_killed_worker_costs_only_its_steps_in_flight(overlap, partial, kill_after) -> None:
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(overlap=overlap), prompts, None, False)
    engine = _engine(overlap=overlap)
    tokens, in_flight = _run(engine, prompts, kill_after, partial)
    assert tokens == undisturbed
    assert engine.restarts.reattaches == 1
    assert 0 < engine.restarts.tokens_recomputed <= in_flight
    assert engine.scheduler.tokens_recomputed == engine.restarts.tokens_recomputed


def _next_turn_hits(kill_after: int | None) -> tuple[int, list[list[int]]]:
    """Prefix-cache hits (tokens) of a second turn of the same conversations, and its text."""
    engine = _engine()
    prompts = make_prompts(2, 24, vocab_size=1000, seed=4)
    first, _ = _run(engine, prompts, kill_after, True)
    turns = [p + first[f"r{i}"] + [7, 8, 9] for i, p in enumerate(prompts)]
    before = engine.scheduler.cache.hits
    outputs = engine.generate(turns, PARAMS)
    return engine.scheduler.cache.hits - before, [o.new_token_ids for o in outputs]


@pytest.mark.parametrize("kill_after", [3, 8])
def test_the_prefix_cache_survives_a_reattach(kill_after: int) -> None:
    hits, text = _next_turn_hits(kill_after)
    assert (hits, text) == _next_turn_hits(None)
    assert hits >= 2 * 32


@pytest.mark.parametrize("kills", [1, 3, 6])
def test_soak_with_worker_kills_same_text_and_every_audit_passes(kills: int) -> None:
    prompts = make_prompts(10, 6, vocab_size=1000, seed=2)
    calm = soak(SimWorker(12, 4, 4).shared(), CONFIG, prompts, PARAMS)
    report = soak(SimWorker(12, 4, 4).shared(), CONFIG, prompts, PARAMS, kills=kills, seed=kills)
    assert report.outputs == calm.outputs
    assert report.kills == kills and report.reattaches == kills
    assert report.kill_recomputed <= report.kill_in_flight
    assert "worker kills" in report.format()


def test_reattach_conditions_name_the_reason() -> None:
    lost = SimWorker(8, 4, 2).shared().ready()
    good = msgspec.structs.replace(lost, pool_generation=2)
    assert can_reattach(lost, good) == ""
    assert can_reattach(lost, msgspec.structs.replace(good, pool_id="other")) == "new_pool"
    assert can_reattach(lost, msgspec.structs.replace(good, pool_generation=3)) == "generation"
    assert can_reattach(lost, msgspec.structs.replace(good, num_blocks=9)) == "blocks"
    private = msgspec.structs.replace(good, pool_id="", pool_fallback="no_holder")
    assert can_reattach(lost, private) == "no_holder"


def test_a_group_reattaches_only_if_every_rank_took_its_own_pool_over() -> None:
    lost = msgspec.structs.replace(
        SimWorker(8, 4, 2).shared().ready(),
        tensor_parallel_size=3,
        pool_ranks=[("sim-pool", 1), ("pool-1", 1), ("pool-2", 1)],
    )
    good = msgspec.structs.replace(
        lost, pool_generation=2, pool_ranks=[("sim-pool", 2), ("pool-1", 2), ("pool-2", 2)]
    )
    assert can_reattach(lost, good) == "" and rank_mismatch(lost, good) == ("", "")
    fresh = msgspec.structs.replace(good, pool_ranks=[("sim-pool", 2), ("new", 1), ("pool-2", 2)])
    assert can_reattach(lost, fresh) == "new_pool"
    assert rank_mismatch(lost, fresh)[1] == "rank 1 attached pool new, not pool-1"
    stale_ranks = [("sim-pool", 2), ("pool-1", 2), ("pool-2", 3)]
    stale = msgspec.structs.replace(good, pool_ranks=stale_ranks)
    assert can_reattach(lost, stale) == "generation"
    assert rank_mismatch(lost, stale)[1] == "rank 2 attached pool pool-2 at generation 3, not 2"
    fewer = msgspec.structs.replace(good, pool_ranks=good.pool_ranks[:2])
    assert can_reattach(lost, fewer) == "ranks"


def test_a_group_with_a_rank_on_a_new_pool_recomputes_with_the_same_text() -> None:
    """The engine's side: a group re-attached but for one rank falls back, counted by reason."""
    prompts = make_prompts(4, 10, vocab_size=1000, seed=4)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    ranks = [("sim-pool", 1), ("pool-1", 1)]
    engine.ready_info = msgspec.structs.replace(engine.ready_info, pool_ranks=ranks)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(4):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    engine.worker_lost(keep=True)
    assert engine.restarts.kept
    engine.worker = engine.worker.successor()
    engine.worker._ready = msgspec.structs.replace(
        engine.worker.ready(), pool_ranks=[("sim-pool", 2), ("another", 1)]
    )
    assert engine.fit(engine.worker.ready()) == []
    assert engine.restarts.fallbacks == {"new_pool": 1} and engine.restarts.reattaches == 0
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens == undisturbed


def test_a_new_pool_falls_back_to_recompute_with_the_same_text() -> None:
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(4):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    engine.worker_lost(keep=True)
    engine.worker = SimWorker(64, 4, 4)  # a holder restarted: a pool of its own, empty
    engine.worker._ready = msgspec.structs.replace(
        engine.worker.ready(), pool_id="fresh", pool_generation=1
    )
    assert engine.fit(engine.worker.ready()) == []
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens == undisturbed
    assert engine.restarts.fallbacks == {"new_pool": 1}
    assert engine.restarts.reattaches == 0
    assert engine.restarts.tokens_recomputed > 4 * 10


def _kill_and_reattach(engine: Engine, corrupt: bool = False) -> int | None:
    """Kill the engine's worker with steps in flight and re-attach its successor; with
    ``corrupt``, flip a bit of the oldest running request's first block first. Returns that
    block."""
    while engine.can_plan() and engine.plan() is not None:
        pass
    engine.worker_lost(keep=True)
    successor = engine.worker.successor()
    block = None
    if corrupt:
        block = engine.scheduler.running[0].block_ids[0]
        successor.corrupt(block, offset=1)
    engine.worker = successor
    assert engine.fit(successor.ready()) == []
    return block


def test_a_corrupted_block_is_named_and_its_request_recomputed(caplog) -> None:
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(4):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    victim = engine.scheduler.running[0].request_id
    block = _kill_and_reattach(engine, corrupt=True)
    with caplog.at_level("ERROR", logger="nanoserve.scheduler"):
        while engine.has_unfinished():
            for output in engine.step():
                tokens[output.request_id] += output.new_token_ids
    assert f"KV block {block} fails its checksum after the re-attach (held by {victim})" in (
        caplog.text
    )
    assert engine.sums.corrupt_total == 1
    assert tokens == undisturbed  # the corrupted K/V never produced a token


def test_without_the_check_the_corruption_is_read() -> None:
    """Why the check exists: the same corruption, unchecked, is read by the victim's next step
    (the SimWorker, which keeps token ids as its K/V, refuses it; a model would not notice)."""
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(4):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    _kill_and_reattach(engine, corrupt=True)
    engine._verify = []  # corrupt one thing: no check after the re-attach
    with pytest.raises(ValueError, match="its cached blocks do not hold its prefix"):
        while engine.has_unfinished():
            engine.step()


def test_the_audit_checks_the_rows_kept_across_a_reattach() -> None:
    engine = _engine()
    for i, prompt in enumerate(make_prompts(3, 10, vocab_size=1000, seed=5)):
        engine.add_request(f"r{i}", prompt, PARAMS)
    for _ in range(3):
        engine.step()
    _kill_and_reattach(engine)
    rows = engine.worker.rows()
    engine.audit(rows)  # every kept row is empty until its next step begins it
    kept = engine.scheduler.running[0]
    wrong = [
        msgspec.structs.replace(row, request_id=kept.request_id, num_cached=1)
        if row.slot == kept.slot
        else row
        for row in rows
    ]
    with pytest.raises(InvariantViolation, match="kept across a re-attach, already has a row"):
        engine.audit(wrong)
    kept.num_pending = 1  # corrupt one thing: a kept request with a pending token
    with pytest.raises(InvariantViolation, match="kept across a re-attach, has 1 pending"):
        engine.audit(rows)


def _running_mid_block(engine: Engine, tokens: dict[str, list[int]]) -> None:
    """Step until, with as many steps in flight as may be, a running request's answered tokens
    end inside a block: a worker that dies now leaves it a partial last block."""
    size = engine.scheduler.allocator.block_size
    for _ in range(40):
        while engine.can_plan() and engine.plan() is not None:
            pass
        unanswered: dict[str, int] = {}
        for step in engine.in_flight:
            for item in step.items:
                unanswered[item.request_id] = unanswered.get(item.request_id, 0) + len(
                    item.token_ids
                )
        if any(
            (r.num_computed - unanswered.get(r.request_id, 0)) % size
            for r in engine.scheduler.running
        ):
            return
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    raise AssertionError("no running request ends inside a block")


def _partial_victim(engine: Engine) -> tuple[str, int, int]:
    """After the kill: a kept request with a partial last block, that block, and how many of
    its slots hold the request's K/V."""
    size = engine.scheduler.allocator.block_size
    for request in engine.scheduler.running:
        if request.num_computed % size:
            block = request.block_ids[request.num_computed // size]
            return request.request_id, block, request.num_computed % size
    raise AssertionError("no kept request ends inside a block")


def _start(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(3):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    _running_mid_block(engine, tokens)
    return tokens


def _finish(engine: Engine, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens


def test_a_reattach_checks_every_slot_of_the_partial_blocks() -> None:
    """The check after a re-attach asks, for each kept request with a partial last block, for
    ranges that tile exactly the slots its answered steps wrote there."""
    engine = _engine()
    _start(engine, make_prompts(4, 10, vocab_size=1000, seed=3))
    _kill_and_reattach(engine)
    check = engine.plan()
    size = engine.scheduler.allocator.block_size
    partial = {
        r.block_ids[r.num_computed // size]: r.num_computed % size
        for r in engine.scheduler.running
        if r.num_computed % size
    }
    assert partial and not check.items
    asked: dict[int, list[int]] = {}
    for block, first, end in check.verify_ranges:
        asked.setdefault(block, []).extend(range(first, end))
    assert asked == {block: list(range(n)) for block, n in partial.items()}


def test_a_corrupted_slot_of_a_partial_block_is_named_and_its_request_recomputed(caplog) -> None:
    """A flipped slot in a kept request's partial last block (one its answered steps wrote) is
    caught by the check of that block's slot ranges: named, and the request recomputed."""
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    tokens = _start(engine, prompts)
    engine.worker_lost(keep=True)
    victim, block, written = _partial_victim(engine)
    slot = written - 1  # the last slot its answered steps wrote
    [(first, end)] = [(a, e) for a, e, _ in engine.sums.ranges[block] if a <= slot < e]
    successor = engine.worker.successor()
    successor.corrupt(block, offset=slot)
    engine.worker = successor
    assert engine.fit(successor.ready()) == []
    with caplog.at_level("ERROR", logger="nanoserve.scheduler"):
        _finish(engine, tokens)
    assert (
        f"KV block {block} fails its checksum after the re-attach (held by {victim}; slots "
        f"{first} to {end - 1} of its partial last block): recomputing"
    ) in caplog.text, caplog.text
    assert engine.sums.corrupt_total == 1
    assert tokens == undisturbed  # the corrupted K/V never produced a token


def test_the_partial_block_check_fires_on_one_corrupted_recorded_sum(caplog) -> None:
    """Corrupt exactly one recorded sum, of one slot range of a kept request's partial block:
    the check names that block and request, and the request is recomputed to the same text."""
    prompts = make_prompts(4, 10, vocab_size=1000, seed=3)
    undisturbed, _ = _run(_engine(), prompts, None, False)
    engine = _engine()
    tokens = _start(engine, prompts)
    engine.worker_lost(keep=True)
    victim, block, _ = _partial_victim(engine)
    first, end, crc = engine.sums.ranges[block][0]
    engine.sums.ranges[block][0] = (first, end, crc ^ 1)
    engine.worker = engine.worker.successor()
    assert engine.fit(engine.worker.ready()) == []
    with caplog.at_level("ERROR", logger="nanoserve.scheduler"):
        _finish(engine, tokens)
    assert (
        f"KV block {block} fails its checksum after the re-attach (held by {victim}; slots "
        f"{first} to {end - 1} of its partial last block): recomputing"
    ) in caplog.text, caplog.text
    assert engine.sums.corrupt_total == 1
    assert engine.restarts.reattaches == 1
    assert tokens == undisturbed
