"""Engine: plan/apply, stop conditions, and aborts wherever the request is."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams, StepResult
from scheduler.errors import LivelockError
from scheduler.sim_worker import SimWorker
from tests.scheduler.conftest import GREEDY, assert_all_back, make_engine, prompts, run_to_end


def test_generate_returns_every_token_in_prompt_order() -> None:
    engine = make_engine(num_blocks=64, num_slots=2)
    outs = engine.generate(prompts(5), GREEDY)
    assert [len(o.new_token_ids) for o in outs] == [9] * 5
    assert all(o.finish_reason == "length" for o in outs)
    alone = [make_engine(num_blocks=64).generate([p], GREEDY)[0] for p in prompts(5)]
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in alone]


def test_merged_outputs_keep_every_logprob_and_alternative() -> None:
    from protocol.messages import RequestOutput
    from scheduler.batch import merge_outputs

    steps = [
        RequestOutput(
            request_id="r", new_token_ids=[5], logprobs=[-0.1], top_logprobs=[[(5, -0.1)]]
        ),
        RequestOutput(
            request_id="r", new_token_ids=[6, 7], logprobs=[-0.2, -0.3],
            top_logprobs=[[(6, -0.2), (1, -2.0)], [(7, -0.3)]], finish_reason="length",
        ),
    ]  # fmt: skip
    merged = merge_outputs("r", steps)
    assert merged.new_token_ids == [5, 6, 7] and merged.logprobs == [-0.1, -0.2, -0.3]
    assert merged.top_logprobs == [[(5, -0.1)], [(6, -0.2), (1, -2.0)], [(7, -0.3)]]
    plain = merge_outputs("r", [RequestOutput(request_id="r", new_token_ids=[5])])
    assert plain.logprobs is None and plain.top_logprobs is None


def test_plan_sends_params_on_a_row_start_and_deltas_after() -> None:
    engine = make_engine(num_blocks=16, num_slots=1, overlap=False)
    engine.add_request("r", [1, 2, 3, 4, 5], GREEDY)
    first = engine.plan()
    (item,) = first.items
    assert (item.start, item.params, item.prompt_len, len(item.new_blocks)) == (0, GREEDY, 5, 2)
    engine.apply(engine.worker.execute(first))
    second = engine.plan()
    (item,) = second.items
    assert (item.start, item.params, item.new_blocks, len(item.token_ids)) == (5, None, [], 1)


def test_apply_rejects_a_result_for_another_step() -> None:
    engine = make_engine()
    engine.add_request("r", [1, 2], GREEDY)
    step = engine.plan()
    with pytest.raises(RuntimeError, match="is not the oldest in flight"):
        engine.apply(StepResult(step_id=step.step_id + 1, samples=[]))


def test_eos_stops_unless_ignored_and_stop_ids_stop() -> None:
    probe = make_engine(num_blocks=64).generate([[1, 2, 3]], GREEDY)[0].new_token_ids
    eos = probe[2]
    engine = make_engine(num_blocks=64, eos_token_ids=(eos,))
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=9, temperature=0.0))
    assert out.new_token_ids == probe[:3] and out.finish_reason == "stop"
    (out,) = engine.generate([[1, 2, 3]], GREEDY)  # ignore_eos
    assert out.new_token_ids == probe
    stop = SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[probe[1]], ignore_eos=True)
    (out,) = engine.generate([[1, 2, 3]], stop)
    assert out.new_token_ids == probe[:2] and out.finish_reason == "stop"
    late = SamplingParams(max_tokens=9, stop_token_ids=[probe[1]], min_tokens=4, ignore_eos=True)
    (out,) = engine.generate([[1, 2, 3]], late)
    assert out.new_token_ids == probe and out.finish_reason == "length"


def test_abort_waiting_request() -> None:
    engine = make_engine(num_blocks=64, num_slots=1)
    engine.add_request("a", [1, 2], GREEDY)
    engine.add_request("b", [3, 4], GREEDY)
    engine.step()
    out = engine.abort("b")
    assert out.finish_reason == "abort" and engine.scheduler.get("b") is None
    engine.audit(engine.worker.rows())
    run_to_end(engine)
    assert_all_back(engine)
    assert engine.abort("b") is None  # gone: aborting again is a no-op


def test_abort_running_request_frees_at_once() -> None:
    engine = make_engine(num_blocks=16, num_slots=2)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.step()
    engine.abort("a")
    assert engine.scheduler.allocator.num_free == 16
    assert engine.scheduler.slots.pending_releases == (0,)
    engine.audit(engine.worker.rows())  # the row still shows "a": its release is pending
    assert engine.worker.rows()[0].request_id == "a"
    assert_all_back(engine)


def test_abort_preempted_request() -> None:
    engine = make_engine(num_blocks=5, num_slots=3)
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(60):
        engine.step()
        engine.audit(engine.worker.rows())
        victims = [r for r in engine.scheduler.waiting if r.num_preemptions]
        if victims:
            engine.abort(victims[0].request_id)
            engine.audit(engine.worker.rows())
            run_to_end(engine)
            assert_all_back(engine)
            return
    pytest.fail("nothing was preempted")


@pytest.mark.parametrize("which", ["a", "b"])
def test_abort_between_plan_and_apply(which: str) -> None:
    engine = make_engine(num_blocks=16, num_slots=2, overlap=False)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.add_request("b", [6, 7, 8], GREEDY)
    engine.step()
    step = engine.plan()
    result = engine.worker.execute(step)  # the worker computed for both
    engine.abort(which)  # ...but the abort lands before the result is applied
    outputs = engine.apply(result)
    assert [o.request_id for o in outputs] == ["b" if which == "a" else "a"]
    engine.audit(engine.worker.rows())
    run_to_end(engine)
    assert_all_back(engine)


def test_abort_of_a_request_admitted_in_the_step_in_flight() -> None:
    engine = make_engine(num_blocks=16, num_slots=2, overlap=False)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    step = engine.plan()
    result = engine.worker.execute(step)
    engine.abort("a")
    assert engine.apply(result) == []
    assert engine.scheduler.allocator.num_free == 16
    engine.audit(engine.worker.rows())
    assert_all_back(engine)


def test_step_raises_on_a_stall_instead_of_spinning() -> None:
    engine = make_engine(num_blocks=8, num_slots=1, audit=False)
    engine.add_request("r", [1, 2], GREEDY)
    engine.scheduler.allocator.allocate(8)  # every block lost outside the ledgers
    with pytest.raises(LivelockError, match="request r waits for 1 blocks, 0 free, reserve 0"):
        engine.step()


def test_stats_count_steps_blocks_and_preemptions() -> None:
    engine = make_engine(num_blocks=5, num_slots=3, overlap=False)
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_total) == (2, 2, 5)
    assert stats.kv_blocks_used == 4 and stats.num_steps_total == 1
    run_to_end(engine)
    assert engine.stats().num_preemptions_total == engine.scheduler.num_preemptions_total > 0
    assert not engine.scheduler.running and engine.stats().kv_blocks_used == 0


def test_num_steps_total_counts_applied_steps_not_planned_ones() -> None:
    engine = make_engine(num_blocks=16, num_slots=2)  # overlap: two steps in flight
    engine.add_request("r", [1, 2, 3], GREEDY)
    first, second = engine.plan(), engine.plan()
    assert first is not None and second is not None
    stats = engine.stats()
    assert (stats.num_steps_total, stats.steps_in_flight) == (0, 2)
    engine.apply(engine.worker.execute(first))
    stats = engine.stats()
    assert (stats.num_steps_total, stats.steps_in_flight) == (1, 1)


def test_a_new_worker_with_another_pool_size_takes_the_requests_it_can_hold() -> None:
    """Requests move to the new pool after a worker is lost; one the smaller pool could never
    hold ends with an error, the rest finish with the text they would have had."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    roomy = make_engine(num_blocks=40, num_slots=3)
    expected = [o.new_token_ids for o in roomy.generate(prompts(3, length=6), params)]
    engine = make_engine(num_blocks=40, num_slots=3)
    for i, prompt in enumerate(prompts(3, length=6)):
        engine.add_request(f"r{i}", prompt, params)
    engine.add_request("big", list(range(200, 230)), params)  # 41 tokens at most: 11 blocks
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(3)} | {"big": []}
    for out in engine.step():
        outs[out.request_id] += out.new_token_ids
    engine.worker = SimWorker(10, 4, 3)
    (failed,) = engine.fit(engine.worker.ready())  # the lost worker's successor
    assert failed.request_id == "big" and failed.finish_reason == "error"
    assert "pool of 10 blocks cannot hold" in failed.error
    assert engine.scheduler.allocator.num_blocks == 10 and engine.ready_info.num_blocks == 10
    while engine.has_unfinished() or engine.num_in_flight:
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    assert [outs[f"r{i}"] for i in range(3)] == expected
    assert_all_back(engine)
