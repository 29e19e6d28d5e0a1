"""The soak and its leak experiment (an audited run under pressure names the one lost block that
the output never shows), and the watermark sweep."""

from __future__ import annotations

import pytest

from nanoserve.bench.watermark import sweep_watermarks
from protocol.messages import SamplingParams
from scheduler.audit import InvariantViolation
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sim_worker import SimWorker
from scheduler.soak import LeakyAllocator, make_prompts, soak

PARAMS = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
CONFIG = SchedulerConfig(token_budget=16, watermark_blocks=0)


def test_leak_experiment_stops_with_the_block_named() -> None:
    prompts = make_prompts(12, 6, vocab_size=1000, seed=0)
    allocator = LeakyAllocator(10, 4, leak_on=3)
    with pytest.raises(InvariantViolation) as caught:
        soak(SimWorker(10, 4, 3), CONFIG, prompts, PARAMS, allocator=allocator)
    assert allocator.leaked is not None
    assert f"block {allocator.leaked} is allocated but no request holds it" in str(caught.value)
    assert str(caught.value).startswith("at iteration ")


def test_leak_experiment_without_the_fault_passes() -> None:
    prompts = make_prompts(12, 6, vocab_size=1000, seed=0)
    report = soak(SimWorker(10, 4, 3), CONFIG, prompts, PARAMS)
    assert all(len(o) == 9 for o in report.outputs)


def test_the_leak_is_invisible_in_the_output() -> None:
    """Why the audit exists: without it the leaky run gives the same answers, one block short."""
    prompts = make_prompts(12, 6, vocab_size=1000, seed=0)
    clean = Engine.for_worker(SimWorker(10, 4, 3), CONFIG).generate(prompts, PARAMS)
    allocator = LeakyAllocator(10, 4, leak_on=3)
    leaky = Engine.for_worker(SimWorker(10, 4, 3), CONFIG, allocator=allocator)
    outs = leaky.generate(prompts, PARAMS)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in clean]
    assert allocator.num_free == 9


@pytest.mark.parametrize("num_blocks, evicted", [(64, False), (16, False), (8, True), (5, True)])
def test_soak_pool_sweep_same_text(num_blocks: int, evicted: bool) -> None:
    prompts = make_prompts(6, 6, vocab_size=1000, seed=1)
    roomy = soak(SimWorker(64, 4, 3), CONFIG, prompts, PARAMS)
    report = soak(SimWorker(num_blocks, 4, 3), CONFIG, prompts, PARAMS)
    assert report.outputs == roomy.outputs
    assert (report.evictions > 0) == evicted
    assert (report.recompute_share > 0) == evicted
    assert report.max_preemptions == max(report.evictions_per_request.values())


def test_hard_soak_oldest_never_evicted() -> None:
    prompts = make_prompts(10, 6, vocab_size=1000, seed=2)
    report = soak(SimWorker(6, 4, 4), CONFIG, prompts, PARAMS)
    assert report.evictions > 5 and report.evictions_per_request["soak-0"] == 0
    assert "every block back" in report.format()


def test_sweep_watermarks_trades_evictions_for_iterations() -> None:
    points = sweep_watermarks([0, 1, 2, 3])
    assert [p.reserve_blocks for p in points] == [0, 1, 2, 3]
    assert points[0].evictions > points[-1].evictions == 0
    assert points[-1].iterations > points[0].iterations
    assert all(p.same_text for p in points)
    assert all(p.thrashed <= p.evictions for p in points)
