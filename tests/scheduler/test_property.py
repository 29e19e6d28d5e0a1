"""Property: random workloads, pools, budgets, watermarks and aborts, audited every iteration,
always terminate with every block and slot back, with and without overlap; and overlap never
changes a request's tokens."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.messages import SamplingParams
from scheduler.errors import RequestRejected
from scheduler.sim_worker import SimWorker
from tests.scheduler.conftest import assert_all_back, make_engine

request_strategy = st.tuples(
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 15),  # iteration it arrives at
    st.one_of(st.none(), st.integers(0, 40)),  # iteration it is aborted at, if any
    st.booleans(),  # abort between plan and apply (mid-step) rather than between steps
)


@pytest.mark.parametrize("overlap", [False, True])
@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    num_blocks=st.integers(1, 24),
    block_size=st.integers(1, 8),
    num_slots=st.integers(1, 6),
    token_budget=st.integers(1, 32),
    watermark=st.integers(0, 24),
    requests=st.lists(request_strategy, min_size=1, max_size=12),
)
def test_random_workloads_terminate_with_everything_back(
    overlap: bool,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    token_budget: int,
    watermark: int,
    requests: list[tuple[int, int, int, int | None, bool]],
) -> None:
    engine = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        num_slots=num_slots,
        token_budget=token_budget,
        watermark_blocks=min(watermark, num_blocks),
        eos_token_ids=(3, 5, 7),
        overlap=overlap,
    )
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    for iteration in range(5000):
        while pending and pending[0][1][2] <= iteration:
            i, (length, max_tokens, _, _, _) = pending.pop(0)
            prompt = [(i * 31 + j) % 1000 for j in range(length)]
            try:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
            except RequestRejected:
                need = -(-(min(length + max_tokens, 4096) - 1) // block_size)
                assert need > num_blocks
        while engine.can_plan() and engine.plan() is not None:
            pass  # with overlap, step N+1 is planned before step N's result is applied
        in_flight = engine.in_flight
        result = engine.worker.execute(in_flight[0]) if in_flight else None
        for i, (_, _, _, abort_at, mid_step) in enumerate(requests):
            if abort_at == iteration and mid_step:
                engine.abort(f"r{i}")
        if result is not None:
            engine.apply(result)
        for i, (_, _, _, abort_at, mid_step) in enumerate(requests):
            if abort_at == iteration and not mid_step:
                engine.abort(f"r{i}")
        engine.audit(engine.worker.rows())
        if not pending and not engine.has_unfinished():
            break
        assert in_flight or not engine.has_unfinished(), "stalled with work queued"
    else:
        raise AssertionError("did not terminate in 5000 iterations")
    assert_all_back(engine)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    num_blocks=st.integers(3, 24),
    num_slots=st.integers(1, 6),
    token_budget=st.integers(1, 32),
    requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=8),
)
def test_overlap_never_changes_the_tokens(
    num_blocks: int, num_slots: int, token_budget: int, requests: list[tuple[int, int]]
) -> None:
    """EOS and stop-token finishes (known one step late under overlap), length finishes and
    preemptions by recompute: the tokens each request gets are the same either way."""
    prompts = [[(i * 31 + j) % 1000 for j in range(n)] for i, (n, _) in enumerate(requests)]
    params = [
        SamplingParams(max_tokens=m, stop_token_ids=[11, 13], min_tokens=i % 3)
        for i, (_, m) in enumerate(requests)
    ]
    texts = []
    for overlap in (False, True):
        engine = make_engine(
            num_blocks=max(num_blocks, 6),
            block_size=4,
            num_slots=num_slots,
            token_budget=token_budget,
            eos_token_ids=(3, 5, 7),
            overlap=overlap,
            vocab_size=20,  # a token in four stops a request: stop finishes are common
        )
        outs = engine.generate(prompts, params)
        texts.append([(o.new_token_ids, o.finish_reason) for o in outs])
        assert_all_back(engine)
    assert texts[0] == texts[1]
    reasons = [reason for _, reason in texts[1]]
    event(f"stop finishes: {reasons.count('stop') > 0}")


shared_request = st.tuples(
    st.integers(0, 2),  # which stem it starts with
    st.integers(0, 8),  # tail length after the stem
    st.integers(1, 10),  # max_tokens
    st.integers(0, 15),  # iteration it arrives at
    st.one_of(st.none(), st.integers(0, 40)),  # iteration it is aborted at, if any
    st.sampled_from([None, "tenant-a"]),  # cache salt
)


@settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    num_blocks=st.integers(2, 24),
    block_size=st.integers(1, 6),
    num_slots=st.integers(1, 5),
    token_budget=st.integers(1, 32),
    watermark=st.integers(0, 24),
    stems=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    requests=st.lists(shared_request, min_size=1, max_size=12),
    lose_worker_at=st.one_of(st.none(), st.integers(0, 30)),
)
def test_shared_prefixes_terminate_with_everything_back(
    num_blocks: int,
    block_size: int,
    num_slots: int,
    token_budget: int,
    watermark: int,
    stems: list[int],
    requests: list[tuple[int, int, int, int, int | None, str | None]],
    lose_worker_at: int | None,
) -> None:
    """Prefix caching under pressure, aborts and a worker loss: audited every iteration (the
    cache's checks included), and a new worker's SimWorker raises on any read of K/V it never
    computed, so a hit that outlived the worker fails here."""
    engine = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        num_slots=num_slots,
        token_budget=token_budget,
        watermark_blocks=min(watermark, num_blocks),
        eos_token_ids=(3, 5, 7),
    )
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    for iteration in range(5000):
        while pending and pending[0][1][3] <= iteration:
            i, (stem, tail, max_tokens, _, _, salt) = pending.pop(0)
            prompt = [900 + stem * 7 + j for j in range(stems[stem])]
            prompt += [i * 13 + j for j in range(tail)]
            if not prompt:
                continue
            try:
                engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), salt)
            except RequestRejected:
                assert -(-(min(len(prompt) + max_tokens, 4096) - 1) // block_size) > num_blocks
        if iteration == lose_worker_at:
            engine.worker_lost()
            engine.worker = SimWorker(num_blocks, block_size, num_slots, eos_token_ids=(3, 5, 7))
        while engine.can_plan() and engine.plan() is not None:
            pass
        in_flight = engine.in_flight
        if in_flight:
            engine.apply(engine.worker.execute(in_flight[0]))
        for i, (_, _, _, _, abort_at, _) in enumerate(requests):
            if abort_at == iteration:
                engine.abort(f"r{i}")
        engine.audit(engine.worker.rows())
        if not pending and not engine.has_unfinished():
            break
        assert in_flight or not engine.has_unfinished(), "stalled with work queued"
    else:
        raise AssertionError("did not terminate in 5000 iterations")
    assert_all_back(engine)
    event(f"hits: {engine.scheduler.cache.hits > 0}")


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    num_blocks=st.integers(8, 24),  # the largest request (32 tokens) fits an empty pool
    num_slots=st.integers(1, 5),
    token_budget=st.integers(1, 32),
    stem=st.integers(0, 16),
    requests=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 10)), min_size=1, max_size=8),
)
def test_prefix_caching_never_changes_the_tokens(
    num_blocks: int, num_slots: int, token_budget: int, stem: int, requests: list[tuple[int, int]]
) -> None:
    prompts = [
        [800 + j for j in range(stem)] + [(i * 31 + j) % 1000 for j in range(tail)] or [1]
        for i, (tail, _) in enumerate(requests)
    ]
    params = [SamplingParams(max_tokens=m, stop_token_ids=[11, 13]) for _, m in requests]
    texts = []
    for caching in (False, True):
        engine = make_engine(
            num_blocks=num_blocks,
            block_size=4,
            num_slots=num_slots,
            token_budget=token_budget,
            eos_token_ids=(3, 5, 7),
            vocab_size=20,
            prefix_caching=caching,
        )
        outs = engine.generate(prompts, params)
        texts.append([(o.new_token_ids, o.finish_reason) for o in outs])
        assert_all_back(engine)
    assert texts[0] == texts[1]
