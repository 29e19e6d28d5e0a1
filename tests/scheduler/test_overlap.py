"""Overlap: step N+1 is planned before step N's samples are back (two steps in flight)."""

from __future__ import annotations

import pytest

from protocol.messages import PENDING_TOKEN, SamplingParams, StepInput
from scheduler.audit import InvariantViolation
from tests.scheduler.conftest import GREEDY, assert_all_back, make_engine


def test_the_next_decode_names_the_token_the_worker_keeps() -> None:
    engine = make_engine(num_blocks=16, num_slots=1)
    engine.add_request("r", [1, 2, 3, 4, 5], GREEDY)
    first, second = engine.plan(), engine.plan()
    assert second.items[0].token_ids == [PENDING_TOKEN] and second.items[0].start == 5
    assert not engine.can_plan()  # two in flight is the most
    with pytest.raises(RuntimeError, match="2 steps are already in flight"):
        engine.plan()
    sampled = engine.apply(engine.worker.execute(first))[0].new_token_ids[0]
    tokens = [sampled, *engine.apply(engine.worker.execute(second))[0].new_token_ids]
    # The worker fed its own sample back in: position 5 holds the token step 0 drew.
    assert engine.worker._kv[1][1] == sampled  # block 1, offset 1 = position 5 (block size 4)
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    (alone,) = make_engine(num_blocks=16, overlap=False).generate([[1, 2, 3, 4, 5]], GREEDY)
    assert tokens == alone.new_token_ids


def test_a_length_finish_known_in_advance_gets_no_surplus_step() -> None:
    engine = make_engine(num_blocks=16, num_slots=2)
    engine.add_request("one", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0))
    first, second = engine.plan(), engine.plan()
    assert [i.request_id for i in first.items] == ["one"]
    assert second is None  # its only token is pending: nothing else can happen to it
    (out,) = engine.apply(engine.worker.execute(first))
    assert out.finish_reason == "length" and len(out.new_token_ids) == 1


def test_an_eos_finish_costs_one_surplus_step_whose_token_is_dropped() -> None:
    probe = make_engine(num_blocks=64, overlap=False).generate([[1, 2, 3]], GREEDY)[0]
    eos = probe.new_token_ids[2]
    engine = make_engine(num_blocks=64, eos_token_ids=(eos,))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.new_token_ids[0] for o in outputs] == probe.new_token_ids[:3]
    assert outputs[-1].finish_reason == "stop"
    (surplus,) = engine.in_flight  # planned before the EOS was seen
    assert surplus.items[0].request_id == "r" and surplus.items[0].token_ids == [PENDING_TOKEN]
    assert engine.drain() == []  # computed, and its token dropped
    assert_all_back(engine)


def test_a_request_preempted_with_a_step_in_flight_recomputes_the_same_text() -> None:
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = make_engine(num_blocks=64, overlap=False).generate(prompts, params)
    engine = make_engine(num_blocks=6, num_slots=3)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to preempt"
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in expected]
    assert_all_back(engine)


def test_an_abort_with_two_steps_in_flight_frees_at_once_and_drops_both_samples() -> None:
    engine = make_engine(num_blocks=16, num_slots=2)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    first, second = engine.plan(), engine.plan()
    engine.abort("a")
    assert engine.scheduler.allocator.num_free == 16 - 1  # only b's block is still held
    outs = engine.apply(engine.worker.execute(first)) + engine.apply(engine.worker.execute(second))
    assert [o.request_id for o in outs] == ["b", "b"]
    engine.audit(engine.worker.rows())  # a's row awaits release; nothing of it is held
    while engine.has_unfinished():
        engine.step()
    assert_all_back(engine)


def test_the_audit_sees_the_rows_as_the_step_in_flight_leaves_them() -> None:
    engine = make_engine(num_blocks=16, num_slots=2)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.step()  # step 0 ran; step 1 is in flight
    rows = engine.worker.rows()
    engine.audit(rows)  # the ledgers are one step ahead of these rows, and that is fine
    batch, step, written = engine._in_flight[0]
    dropped = StepInput(step_id=step.step_id, items=[], released_slots=step.released_slots)
    engine._in_flight[0] = (batch, dropped, written)  # corrupt one thing: the step in flight
    with pytest.raises(
        InvariantViolation,
        match="row of slot 0 holds K/V for 5 tokens but request a has computed 6",
    ):
        engine.audit(rows)


def test_a_worker_lost_with_two_steps_in_flight_releases_every_row() -> None:
    engine = make_engine(num_blocks=16, num_slots=3)
    engine.add_request("a", [1, 2, 3], GREEDY)
    first, _ = engine.plan(), engine.plan()
    engine.worker.execute(first)  # the worker ran one step, then was lost
    engine.worker_lost()
    assert engine.in_flight == [] and engine.scheduler.slots.pending_releases == (0, 1, 2)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    (alone,) = make_engine(num_blocks=16, overlap=False).generate([[1, 2, 3]], GREEDY)
    assert tokens == alone.new_token_ids
    assert_all_back(engine)


@pytest.mark.parametrize("start,stop", [(0, 3), (1, 5), (3, 6), (4, 7), (6, 7), (0, 7), (2, 2)])
def test_token_slice_reads_prompt_outputs_then_pending(start: int, stop: int) -> None:
    from scheduler.request import Request

    request = Request("r", [10, 11, 12, 13], GREEDY, arrival=0, output_token_ids=[20, 21])
    request.num_pending = 1
    whole = [10, 11, 12, 13, 20, 21, PENDING_TOKEN]
    assert request.token_slice(start, stop) == whole[start:stop]
