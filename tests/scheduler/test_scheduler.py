"""Scheduler: admission, growth, preemption by recompute, chunked prefill, the watermark."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams
from scheduler.block_allocator import BlockAllocator
from scheduler.errors import RequestRejected
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from tests.scheduler.conftest import GREEDY, assert_all_back, make_engine, prompts, run_to_end


def test_admits_in_arrival_order_up_to_the_slots() -> None:
    engine = make_engine(num_blocks=64, num_slots=2)
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    sched = engine.scheduler
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    assert sorted(r.slot for r in sched.running) == [0, 1]


def test_preemption_takes_the_newest_and_never_the_oldest() -> None:
    engine = make_engine(num_blocks=5, num_slots=3, token_budget=64)
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, GREEDY)
    victims = []
    while engine.has_unfinished():
        before = {r.request_id: r.num_preemptions for r in engine.scheduler.running}
        newest = engine.scheduler.running[-1].request_id if engine.scheduler.running else None
        engine.step()
        for rid in before:
            req = engine.scheduler.get(rid)
            if req is not None and req.num_preemptions > before[rid]:
                victims.append(rid)
                assert rid == newest or newest not in before  # the newest goes first
    assert victims, "the pool was meant to be too small"
    assert "r0" not in victims
    assert_all_back(engine)


def test_preempted_request_keeps_its_tokens_and_goes_to_the_head() -> None:
    engine = make_engine(num_blocks=5, num_slots=3)
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(50):
        engine.step()
        preempted = [r for r in engine.scheduler.waiting if r.num_preemptions]
        if preempted:
            head = engine.scheduler.waiting[0]
            assert head is preempted[0] and head.output_token_ids and not head.block_ids
            return
    pytest.fail("no preemption happened")


def test_recompute_gives_the_same_tokens_as_a_roomy_pool() -> None:
    roomy = make_engine(num_blocks=64, num_slots=8).generate(prompts(8), GREEDY)
    tight_engine = make_engine(num_blocks=5, num_slots=3, token_budget=7)
    tight = tight_engine.generate(prompts(8), GREEDY)
    assert tight_engine.scheduler.num_preemptions_total > 0
    assert [o.new_token_ids for o in tight] == [o.new_token_ids for o in roomy]


def test_chunked_prefill_splits_a_long_prompt_over_iterations() -> None:
    engine = make_engine(num_blocks=32, num_slots=2, token_budget=5)
    prompt = list(range(1, 13))  # 12 tokens through a budget of 5: chunks 5, 5, 2
    step = None
    engine.add_request("long", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    seen = []
    while engine.has_unfinished():
        step = engine.plan()
        seen.append([(i.start, len(i.token_ids), i.sample) for i in step.items])
        engine.apply(engine.worker.execute(step))
    assert seen[:3] == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    assert seen[3:] == [[(12, 1, True)], [(13, 1, True)]]
    alone = make_engine(num_blocks=32, token_budget=64).generate(
        [prompt], SamplingParams(max_tokens=3, temperature=0.0)
    )
    assert engine.scheduler.get("long") is None
    assert len(alone[0].new_token_ids) == 3


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    engine = make_engine(num_blocks=64, num_slots=3, token_budget=6, overlap=False)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()  # a prefilled (3 tokens)
    engine.add_request("b", list(range(10, 30)), GREEDY)
    step = engine.plan()
    assert [(i.request_id, len(i.token_ids), i.sample) for i in step.items] == [
        ("a", 1, True),
        ("b", 5, False),
    ]
    engine.apply(engine.worker.execute(step))
    run_to_end(engine)
    assert_all_back(engine)


@pytest.mark.parametrize("length", [4, 8, 12])
def test_prompt_that_exactly_fills_its_blocks(length: int) -> None:
    engine = make_engine(num_blocks=16, num_slots=1, block_size=4)
    engine.add_request(
        "x", list(range(1, length + 1)), SamplingParams(max_tokens=3, temperature=0.0)
    )
    first = engine.plan()
    assert first.items[0].new_blocks and len(first.items[0].new_blocks) == length // 4
    engine.apply(engine.worker.execute(first))
    engine.audit(engine.worker.rows())
    second = engine.plan()  # the first decode crosses the block boundary at once
    assert second.items[0].start == length and len(second.items[0].new_blocks) == 1
    engine.apply(engine.worker.execute(second))
    engine.audit(engine.worker.rows())
    run_to_end(engine)
    assert_all_back(engine)


def test_add_request_refuses_what_can_never_fit() -> None:
    engine = make_engine(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="may need 5 blocks, the whole pool has 4"):
        engine.add_request("big", list(range(10)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="max_model_len 64"):
        engine.add_request("long", list(range(64)), SamplingParams(max_tokens=1))
    with pytest.raises(RequestRejected, match="needs a prompt"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("ok", list(range(10)), SamplingParams(max_tokens=7))  # 16 tokens cached
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request("ok", [1], SamplingParams())


def test_max_model_len_caps_the_need_and_stops_the_request() -> None:
    engine = make_engine(num_blocks=4, block_size=4, max_model_len=12)
    engine.add_request("r", list(range(8)), SamplingParams(max_tokens=100, ignore_eos=True))
    (out,) = [o for _ in range(20) for o in engine.step() if o.finish_reason]
    assert out.finish_reason == "length"


def test_watermark_default_is_one_percent_truncated() -> None:
    assert Scheduler(BlockAllocator(99, 4), 2, 8).watermark_blocks == 0
    assert Scheduler(BlockAllocator(4000, 4), 2, 8).watermark_blocks == 40


def test_watermark_delays_admission() -> None:
    engine = make_engine(num_blocks=8, num_slots=3, watermark_blocks=3)
    engine.add_request("a", list(range(12)), GREEDY)  # 3 blocks
    engine.add_request("b", list(range(100, 109)), GREEDY)  # 3 blocks: 3 + 3 > 5 free
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    run_to_end(engine)
    assert_all_back(engine)


def test_watermark_never_excludes_a_fresh_request() -> None:
    # 6 blocks of 4, reserve 3: a 13-token prompt needs 4 blocks, more than the reserve leaves.
    engine = make_engine(num_blocks=6, block_size=4, num_slots=2, watermark_blocks=3)
    engine.add_request("b", list(range(13)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.scheduler.admissible_blocks == 3
    run_to_end(engine)
    assert_all_back(engine)


def test_deadlock_trace_of_note_001_terminates() -> None:
    """b is admitted well inside what the reserve leaves, grows to 4 blocks (growth ignores the
    reserve), is preempted for a; a finishes; the empty pool must take b back although b now
    needs more blocks than the reserve leaves."""
    engine = make_engine(num_blocks=6, block_size=4, num_slots=2, watermark_blocks=3)
    engine.add_request("a", [1], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request("b", list(range(2, 10)), SamplingParams(max_tokens=15, ignore_eos=True))
    b = engine.scheduler.get("b")
    refused_by_the_reserve = False
    for _ in range(200):
        engine.step()
        if b.status is RequestStatus.WAITING and b.num_preemptions:
            need = engine.scheduler.allocator.blocks_for_length(b.num_tokens)
            refused_by_the_reserve |= need > engine.scheduler.admissible_blocks
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert b.num_preemptions >= 1 and refused_by_the_reserve
    assert len(b.output_token_ids) == 15
    assert_all_back(engine)


def test_eos_ends_a_grammar_request_even_before_min_tokens() -> None:
    """The worker lets EOS through under min_tokens only when the grammar is complete: then
    nothing else may follow, so EOS must end the request, not be appended to it."""
    free = Request("free", [1, 2], SamplingParams(min_tokens=4), arrival=0)
    bound = Request("bound", [1, 2], SamplingParams(min_tokens=4, grammar='start: "a"'), 1)
    eos = frozenset({2})
    assert free.stop_reason(2, eos, max_model_len=64) is None
    assert bound.stop_reason(2, eos, max_model_len=64) == "stop"


def _final_blocks(engine) -> dict[str, list[int]]:
    """Run to the end; each request's blocks when it last ran."""
    held: dict[str, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        held.update((r.request_id, list(r.block_ids)) for r in engine.scheduler.running)
    return held


def test_requests_growing_together_each_hold_adjacent_blocks(monkeypatch) -> None:
    """Eight requests decode in one batch, so their growth interleaves block by block; each
    started where it had room for its prompt plus max_tokens, and each still holds one run of
    adjacent blocks (what the worker's attention streams fastest)."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run() -> dict[str, list[int]]:
        engine = make_engine(num_blocks=256, num_slots=8)
        for i, p in enumerate(prompts(8)):
            engine.add_request(f"r{i}", p, params)
        held = _final_blocks(engine)
        assert_all_back(engine)
        return held

    held = run()
    assert len(held) == 8 and all(len(ids) >= 9 for ids in held.values())  # 36 tokens, by 4
    assert all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in held.values()), held
    # without the placement hints the same run interleaves the requests' blocks
    plain = BlockAllocator.allocate
    monkeypatch.setattr(BlockAllocator, "allocate", lambda self, n, **_: plain(self, n))
    held = run()
    assert not all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in held.values())
