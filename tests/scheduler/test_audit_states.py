"""The audit of the allocator's block states (the byte per block the web page draws) fires:
each test corrupts exactly one byte and asserts on the message. Every audited engine in these
tests checks the bytes after every step, so the allocator keeping them is tested there."""

from __future__ import annotations

import pytest

from protocol.messages import SamplingParams
from protocol.monitor import CACHED, FREE, HELD, SHARED
from scheduler.audit import InvariantViolation, audit_all, audit_block_states
from scheduler.engine import Engine
from tests.scheduler.conftest import make_engine

PREFIX = [5, 6, 7, 8] * 3  # three full blocks of 4, shared by the two requests below


@pytest.fixture
def eng() -> Engine:
    """Two running requests sharing a prefix, a finished one's blocks cached-free: all four
    states in one pool, and the audit clean."""
    engine = make_engine(num_blocks=40, block_size=4, num_slots=4, overlap=False)
    engine.add_request("done", [9] * 9, SamplingParams(max_tokens=1, ignore_eos=True))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("first", PREFIX + [1, 2], params)
    engine.step()
    engine.add_request("second", PREFIX + [3], params)
    engine.step()
    engine.step()
    audit_all(engine.scheduler)
    assert set(engine.scheduler.allocator.block_states) == {FREE, CACHED, HELD, SHARED}
    return engine


def _block(engine: Engine, state: int) -> int:
    return engine.scheduler.allocator.block_states.index(state)


@pytest.mark.parametrize(
    ("was", "now", "message"),
    [
        (HELD, FREE, "block {} is held but its state byte says free"),
        (SHARED, HELD, "block {} is shared but its state byte says held"),
        (HELD, SHARED, "block {} is shown as shared but has 1 holder"),
        (CACHED, FREE, "block {} is cached-free but its state byte says free"),
        (FREE, CACHED, "block {} is free but its state byte says cached"),
        (FREE, HELD, "block {} is free but its state byte says held"),
    ],
)
def test_a_wrong_state_byte_is_named(eng: Engine, was: int, now: int, message: str) -> None:
    block = _block(eng, was)
    eng.scheduler.allocator.block_states[block] = now
    with pytest.raises(InvariantViolation, match=message.format(block)):
        audit_block_states(eng.scheduler)
    with pytest.raises(InvariantViolation, match=message.format(block)):
        audit_all(eng.scheduler)  # and the whole audit reaches it


def test_states_that_do_not_cover_the_pool_are_named(eng: Engine) -> None:
    eng.scheduler.allocator.block_states.append(FREE)
    with pytest.raises(InvariantViolation, match="the block states cover 41 blocks of 40"):
        audit_block_states(eng.scheduler)


def test_clearing_the_cache_turns_cached_free_blocks_free(eng: Engine) -> None:
    allocator = eng.scheduler.allocator
    assert allocator.clear_cache() > 0
    assert CACHED not in allocator.block_states
    audit_block_states(eng.scheduler)
