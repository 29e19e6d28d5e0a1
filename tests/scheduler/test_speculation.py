"""Speculative decoding in the scheduler, model-free: the n-gram drafter, its adaptation, the
ledgers of draft tokens (blocks within the watermark, released on rejection, rows rewound) and
the audit's new bound, each check proven to fire. The SimWorker samples at every draft position
as the real worker does, so speculation must never change a token."""

from __future__ import annotations

import pytest

from protocol.messages import Rewind, SamplingParams
from scheduler.audit import InvariantViolation, audit_all
from scheduler.config import SchedulerConfig
from scheduler.drafter import FIRST_PAUSE, MAX_PAUSE, DraftState, NgramIndex
from scheduler.engine import Engine
from scheduler.sim_worker import SimWorker
from scheduler.soak import make_prompts, soak
from scheduler.speculation import Speculation

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _slice(tokens: list[int]):
    return lambda start, stop: tokens[start:stop]


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 5, 6, 7]
    # Suffix (5, 6, 7) occurred at 0..2 and was followed by 8, 9, 1; (6, 7) alone more lately.
    assert NgramIndex().propose(_slice(tokens), len(tokens), 3) == [8, 9, 1]
    assert NgramIndex().propose(_slice(tokens), len(tokens), 1) == [8]
    tokens = [1, 2, 3, 4]
    assert NgramIndex().propose(_slice(tokens), len(tokens), 3) == []  # nothing repeats


def test_ngram_index_grows_with_the_tokens() -> None:
    tokens = [1, 2, 3, 9, 1, 2]
    index = NgramIndex()
    assert index.propose(_slice(tokens), len(tokens), 2) == [3, 9]
    tokens += [3, 9, 4, 1, 2, 3]  # the index takes the new tokens only
    assert index.propose(_slice(tokens), len(tokens), 2) == [9, 4]


def _verify_until_paused(state: DraftState, tokens: int, skipped: int = 0) -> int:
    """Verifications gaining ``tokens`` each, with ``skipped`` steps planned without the
    request meanwhile, until it pauses; how many it took."""
    for count in range(1, 100):
        state.skipped = skipped
        state.verified(tokens)
        if state.paused:
            return count
    return 0


def test_drafts_that_gain_too_little_per_step_pause_for_longer_each_time() -> None:
    state = DraftState()
    pauses = []
    for _ in range(12):
        assert _verify_until_paused(state, 1) > 0  # nothing accepted
        pauses.append(state.pause)
        while state.paused:
            state.tick()
    assert pauses[:3] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE]
    assert max(pauses) == MAX_PAUSE
    for _ in range(5):
        state.verified(4)  # three drafts accepted a step: the backoff starts over
    assert not state.paused
    assert _verify_until_paused(state, 1) > 0 and state.pause == FIRST_PAUSE


def test_what_a_verification_costs_depends_on_the_steps_it_kept_the_request_out_of() -> None:
    """Alone, 2 tokens a verification is worth drafting for; in a busy batch, where the request
    sits out the step planned while its verification flies, it gains 1 a step and pauses."""
    assert _verify_until_paused(DraftState(), tokens=2, skipped=0) == 0
    assert _verify_until_paused(DraftState(), tokens=2, skipped=1) > 0
    assert _verify_until_paused(DraftState(), tokens=4, skipped=1) == 0


def _sim(vocab: int = 4, blocks: int = 64, slots: int = 4) -> SimWorker:
    return SimWorker(num_blocks=blocks, block_size=4, num_slots=slots, vocab_size=vocab)


def _config(spec: str, overlap: bool = True, **kw) -> SchedulerConfig:
    return SchedulerConfig(
        speculative=spec, num_speculative_tokens=3, overlap=overlap, token_budget=10, **kw
    )


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("blocks, evicted", [(64, False), (12, True), (8, True)])
def test_speculation_never_changes_a_token(overlap: bool, blocks: int, evicted: bool) -> None:
    """Audited every iteration, roomy or preempting: the same text, with drafts accepted."""
    prompts = make_prompts(10, 9, vocab_size=4, seed=1)
    plain = soak(_sim(blocks=blocks, slots=3), _config("off", overlap), prompts, GREEDY)
    report = soak(_sim(blocks=blocks, slots=3), _config("ngram", overlap), prompts, GREEDY)
    assert report.outputs == plain.outputs
    assert (report.evictions > 0) == evicted


def _engine(spec: str = "ngram", **kw) -> tuple[Engine, SimWorker]:
    worker = _sim(**kw)
    return Engine.for_worker(worker, _config(spec, audit=True)), worker


def _run(engine: Engine, worker: SimWorker, prompts, params=GREEDY) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    return [o.new_token_ids for o in outs]


def test_drafts_are_verified_and_counted() -> None:
    engine, worker = _engine(vocab=2)  # the SimWorker's tokens hash: half the drafts land
    prompts = make_prompts(4, 12, vocab_size=2, seed=3)
    _run(engine, worker, prompts)
    spec = engine.scheduler.speculation
    assert spec.drafts_total > 0 and 0 < spec.accepted_total < spec.draft_tokens_total
    stats = engine.stats()
    assert stats.spec_drafts_total == spec.drafts_total
    assert stats.spec_accepted_tokens_total == spec.accepted_total


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, num_speculative_tokens=0),
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2),
        SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0.0, logprobs=0),
        SamplingParams(max_tokens=24, temperature=0.0, grammar='{"grammars": []}', min_tokens=2),
    ],
)
def test_requests_that_never_draft(params: SamplingParams) -> None:
    engine, worker = _engine()
    _run(engine, worker, make_prompts(2, 12, vocab_size=4, seed=3), params)
    assert engine.scheduler.speculation.drafts_total == 0


def test_a_request_may_ask_for_drafts_when_the_server_drafts_none() -> None:
    engine, worker = _engine("off")
    params = SamplingParams(max_tokens=24, temperature=0.0, num_speculative_tokens=2)
    outs = _run(engine, worker, make_prompts(2, 12, vocab_size=4, seed=3), params)
    spec = engine.scheduler.speculation
    assert spec.drafts_total > 0 and spec.draft_tokens_total <= 2 * spec.drafts_total
    plain, worker = _engine("off")
    assert outs == _run(plain, worker, make_prompts(2, 12, vocab_size=4, seed=3))


def _drafting(engine: Engine, prompt: list[int]):
    """Plan until the request carries drafts; returns it (its verification in flight)."""
    engine.add_request("r", prompt, GREEDY)
    request = engine.scheduler.get("r")
    for _ in range(40):
        while engine.can_plan() and engine.plan() is not None:
            pass
        if request.num_draft:
            return request
        engine.apply(engine.worker.execute(engine.in_flight[0]))
    raise AssertionError("the request never drafted")


def test_rejected_drafts_give_their_blocks_back_and_rewind_the_row() -> None:
    engine, worker = _engine(vocab=16)
    request = _drafting(engine, [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    held, free = len(request.block_ids), engine.scheduler.allocator.num_free
    while engine.num_in_flight:
        engine.apply(worker.execute(engine.in_flight[0]))
    scheduler = engine.scheduler
    blocks_for = scheduler.allocator.blocks_for_length
    assert len(request.block_ids) == blocks_for(request.num_computed) <= held
    assert scheduler.allocator.num_free == free + held - len(request.block_ids)
    if scheduler.pending_rewinds:  # something was rejected: its row is cut back next step
        (rewind,) = scheduler.pending_rewinds
        assert rewind == Rewind(
            slot=request.slot,
            num_blocks=len(request.block_ids),
            num_cached=request.num_computed,
        )
    engine.audit(worker.rows())


@pytest.mark.parametrize("watermark, fits", [(2, 3), (1, 7), (0, 11)])
def test_drafts_never_take_the_watermark(watermark: int, fits: int) -> None:
    """A pool of 5 blocks of 4, a request holding 2 for its 9 tokens (8 computed): its next
    token needs a third block anyway, so its drafts get that block's 3 free positions, and
    whole blocks more only from what the reserve leaves. Drafts never preempt."""
    worker = _sim(vocab=16, blocks=5)
    engine = Engine.for_worker(worker, _config("ngram", watermark_blocks=watermark))
    engine.add_request("r", [3, 1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=12))
    engine.apply(worker.execute(engine.plan()))
    scheduler = engine.scheduler
    request = scheduler.get("r")
    assert (request.num_computed, len(request.block_ids), scheduler.allocator.num_free) == (8, 2, 3)
    assert len(scheduler._fit_drafts(request, [7] * 16)) == fits


# -- the audit's draft bound, each check proven to fire by corrupting exactly one thing --------
def test_audit_names_drafts_beyond_the_limit() -> None:
    engine, _ = _engine(vocab=16)
    request = _drafting(engine, [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    audit_all(engine.scheduler)
    request.num_draft = 4  # the limit is 3
    with pytest.raises(InvariantViolation, match="4 drafts in flight, more than its limit 3"):
        audit_all(engine.scheduler)


def test_audit_names_drafts_without_their_pending_token() -> None:
    engine, _ = _engine(vocab=16)
    request = _drafting(engine, [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    request.num_pending = 3
    with pytest.raises(InvariantViolation, match="drafts in flight with 3 pending tokens"):
        audit_all(engine.scheduler)


def test_audit_names_blocks_past_the_draft_bound() -> None:
    engine, _ = _engine(vocab=16)
    request = _drafting(engine, [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    audit_all(engine.scheduler)
    request.num_draft -= 1  # one draft fewer in flight than its blocks and K/V were planned for
    want = f"computed {request.num_computed} of {request.num_tokens} tokens and 2 drafts"
    assert request.num_draft == 2
    with pytest.raises(InvariantViolation, match=want):
        audit_all(engine.scheduler)


def test_audit_names_a_waiting_request_with_drafts() -> None:
    engine, _ = _engine(vocab=16)
    engine.add_request("w", [1, 2, 3], GREEDY)
    engine.scheduler.get("w").num_draft = 2
    with pytest.raises(InvariantViolation, match="request w is waiting with 2 drafts"):
        audit_all(engine.scheduler)


def _rewound(engine: Engine, worker: SimWorker):
    """A request whose verification rejected something: its rewind is pending."""
    prompt = [3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    for attempt in range(20):
        engine.add_request(f"r{attempt}", prompt + [attempt % 16], GREEDY)
        request = engine.scheduler.get(f"r{attempt}")
        for _ in range(40):
            while engine.can_plan() and engine.plan() is not None:
                pass
            if not engine.num_in_flight:
                break
            engine.apply(worker.execute(engine.in_flight[0]))
            if engine.scheduler.pending_rewinds:
                return request
    raise AssertionError("no draft was ever rejected")


def test_audit_names_a_rewind_that_keeps_a_rejected_draft() -> None:
    engine, worker = _engine(vocab=16)
    request = _rewound(engine, worker)
    audit_all(engine.scheduler, _projected(engine, worker))
    (rewind,) = engine.scheduler.pending_rewinds
    engine.scheduler._rewinds[rewind.slot] = Rewind(
        slot=rewind.slot, num_blocks=rewind.num_blocks, num_cached=rewind.num_cached + 1
    )
    with pytest.raises(InvariantViolation, match=f"has computed {request.num_computed}"):
        audit_all(engine.scheduler)


def test_audit_names_a_rewind_of_a_free_slot() -> None:
    engine, worker = _engine(vocab=16)
    _rewound(engine, worker)
    (rewind,) = engine.scheduler.pending_rewinds
    free = engine.scheduler.slots.free[0]
    engine.scheduler._rewinds[free] = Rewind(slot=free, num_blocks=1, num_cached=1)
    with pytest.raises(InvariantViolation, match=f"a rewind of slot {free}, which no request"):
        audit_all(engine.scheduler)


def test_audit_rows_sees_the_row_before_its_rewind() -> None:
    """Without projecting the pending rewind, the row still holds the rejected drafts."""
    engine, worker = _engine(vocab=16)
    _rewound(engine, worker)
    engine.audit(worker.rows())  # projected: agrees
    with pytest.raises(InvariantViolation, match="not a prefix of request|holds K/V for"):
        audit_all(engine.scheduler, worker.rows())


def _projected(engine: Engine, worker: SimWorker):
    from protocol.messages import StepInput
    from scheduler.audit import project_rows

    rewinds = list(engine.scheduler.pending_rewinds)
    steps = [*engine.in_flight, StepInput(step_id=-1, items=[], rewinds=rewinds)]
    return project_rows(worker.rows(), steps)


def test_a_verification_is_charged_what_its_step_costs_against_a_decode() -> None:
    """The cost is measured from the worker's step times: where a step with drafts takes 2.5
    decode steps (a 2-core CPU's 4-bit rows), 2 tokens a verification lose time and pause;
    where it costs what a decode costs (the weights' streaming bounds both), they pay."""
    spec = Speculation(num_tokens=4)
    assert spec.verification_cost == 1.0  # nothing measured yet
    for _ in range(20):
        spec.observe(0.004, drafted=False)
        spec.observe(0.010, drafted=True)
    assert spec.verification_cost == pytest.approx(2.5)
    costly, cheap = DraftState(), DraftState()
    for _ in range(20):
        costly.verified(2, spec.verification_cost)
        cheap.verified(2, 1.0)
    assert costly.paused and not cheap.paused
    spec.observe(0.001, drafted=True)  # never below 1: a verification is at least a step
    spec.plain_step_s = 1.0
    assert spec.verification_cost == 1.0


def test_the_engine_measures_decode_steps_only() -> None:
    engine, _ = _engine()
    outs = engine.generate(make_prompts(3, 12, vocab_size=4, seed=3), GREEDY)
    assert all(o.new_token_ids for o in outs)
    spec = engine.scheduler.speculation
    assert spec.plain_step_s is not None and spec.drafted_step_s is not None
    assert spec.drafts_total > 0 and spec.verification_cost >= 1.0
