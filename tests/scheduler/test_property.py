"""Property: random workloads, pools, budgets, watermarks and aborts, audited every iteration,
always terminate with every block and slot back."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.messages import SamplingParams
from scheduler.errors import RequestRejected
from tests.scheduler.conftest import assert_all_back, make_engine

request_strategy = st.tuples(
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 15),  # iteration it arrives at
    st.one_of(st.none(), st.integers(0, 40)),  # iteration it is aborted at, if any
    st.booleans(),  # abort between plan and apply (mid-step) rather than between steps
)


@settings(
    max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
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
        step = engine.plan()
        result = engine.worker.execute(step) if step is not None else None
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
        assert step is not None or not engine.has_unfinished(), "stalled with work queued"
    else:
        raise AssertionError("did not terminate in 5000 iterations")
    assert_all_back(engine)
