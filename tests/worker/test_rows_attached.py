"""A row re-attached to K/V a lost worker wrote into the shared pool (``StepItem.attached``):
accepted only by a worker whose pool an earlier worker used, at any start (not only a block's
end); its blocks up to ``start`` are never zeroed, its last block only past ``start``."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams, StepInput, StepItem
from worker.faults import KillInStep
from worker.kv.cache import KVCache
from worker.kv.written import filled_blocks, partial_ranges
from worker.rows import RowTable, written_blocks

P = SamplingParams(temperature=0.0)


def attached(start: int = 5, blocks=(2, 3), cached: int | None = None) -> StepItem:
    n = start if cached is None else cached
    return StepItem(
        request_id="a",
        slot=0,
        new_blocks=list(blocks),
        token_ids=[7],
        start=start,
        params=P,
        prompt_len=4,
        fresh=True,
        cached_token_ids=list(range(1, n + 1)),
        attached=True,
    )


def table(attached_pool: bool) -> RowTable:
    return RowTable(
        num_slots=2, num_blocks=8, block_size=4, max_model_len=64, seed=0, attached=attached_pool
    )


def test_a_reused_pool_takes_a_row_at_any_start() -> None:
    rows = table(True)
    rows.check(StepInput(step_id=0, items=[attached()]), vocab_size=100)
    row, tokens = rows.apply(attached())
    assert (row.num_cached, row.block_table, tokens) == (6, [2, 3], [7])
    assert row.history == [1, 2, 3, 4, 5, 7]


def test_a_new_pool_refuses_a_reattached_row() -> None:
    with pytest.raises(ValueError, match="a re-attached row, but this worker's pool is new"):
        table(False).check(StepInput(step_id=0, items=[attached()]), vocab_size=100)


def test_a_reattached_row_needs_all_its_tokens() -> None:
    with pytest.raises(ValueError, match="a re-attached row needs its 5 tokens"):
        table(True).check(StepInput(step_id=0, items=[attached(cached=4)]), vocab_size=100)


def test_only_blocks_past_start_are_zeroed_whole() -> None:
    assert written_blocks(attached(start=5, blocks=(2, 3, 6)), 4) == [6]
    assert written_blocks(attached(start=8, blocks=(2, 3, 6)), 4) == [6]


def test_zero_tail_keeps_the_head_of_a_block() -> None:
    cache = KVCache(
        num_layers=2,
        num_blocks=4,
        block_size=4,
        n_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )
    cache.pool[:, :, :, 1] = 1.0
    cache.zero_tail(1, 2)
    assert cache.pool[:, :, :, 1, :2].eq(1.0).all()
    assert not cache.pool[:, :, :, 1, 2:].any()
    first = cache.checksum(1)
    cache.pool[0, 0, 0, 1, 0, 0] = 2.0  # one flipped value changes the block's sum
    assert cache.checksum(1) != first


def test_range_sums_cover_only_their_slots() -> None:
    """A range's sum is of its own slots, every layer, K and V: a value flipped in one slot
    changes the sum of the range holding it and of no other."""
    cache = KVCache(
        num_layers=2, num_blocks=4, block_size=4, n_kv_heads=2, head_dim=2,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    torch.manual_seed(0)
    cache.pool.normal_()
    ranges = [(1, 0, 2), (1, 2, 3), (3, 1, 2)]
    before = cache.range_sums(ranges)
    assert [r[:3] for r in before] == ranges
    assert cache.range_sums([(1, 0, 2)]) == before[:1]  # alone or batched: the same sum
    cache.pool[1, 1, 1, 1, 2, 0] += 1.0  # layer 1, V, head 1, block 1, slot 2
    after = cache.range_sums(ranges)
    assert [b == a for b, a in zip(before, after, strict=True)] == [True, False, True]


def test_partial_ranges_name_the_slots_an_item_leaves_in_its_last_block() -> None:
    rows = table(False)
    item = StepItem(
        request_id="a", slot=0, new_blocks=[2, 3, 6], token_ids=list(range(1, 11)), start=0,
        params=P, prompt_len=10, fresh=True,
    )  # fmt: skip
    step = StepInput(step_id=0, items=[item])
    applied = [rows.apply(item)]
    assert partial_ranges(step, applied, 4) == [(6, 0, 2)]  # positions 8, 9
    assert filled_blocks(step, applied, 4) == [2, 3]
    decode = StepItem(request_id="a", slot=0, new_blocks=[], token_ids=[11], start=10)
    step = StepInput(step_id=1, items=[decode])
    assert partial_ranges(step, [rows.apply(decode)], 4) == [(6, 2, 3)]
    last = StepItem(request_id="a", slot=0, new_blocks=[], token_ids=[12], start=11)
    step = StepInput(step_id=2, items=[last])
    applied = [rows.apply(last)]
    assert partial_ranges(step, applied, 4) == []  # it fills block 6: summed whole
    assert filled_blocks(step, applied, 4) == [6]


def test_the_fault_injector_reads_position_and_layer() -> None:
    injector = KillInStep.parse("1000:14")
    assert (injector.position, injector.layer) == (1000, 14)
    for bad in ("1000", "a:b", "1:2:3", "-1:2"):
        with pytest.raises(ValueError, match="NANOSERVE_FAULT_KILL_AT"):
            KillInStep.parse(bad)
