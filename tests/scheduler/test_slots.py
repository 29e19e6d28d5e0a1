"""Slots: lowest free slot first, and each freed slot's row emptied by exactly the next step."""

from __future__ import annotations

import pytest

from scheduler.slots import Slots


def test_slots_are_taken_lowest_first_and_released_with_the_next_step() -> None:
    slots = Slots(3)
    assert [slots.take(), slots.take()] == [0, 1] and slots.free == [2]
    slots.give_back(0)
    assert slots.free == [0, 2] and slots.pending_releases == (0,)
    assert slots.take() == 0  # at once: the step empties its row before any item runs
    assert slots.take_releases() == [0] and slots.take_releases() == []
    slots.release_all()  # the worker's rows are gone: every one is emptied, free or held
    assert slots.pending_releases == (0, 1, 2) and slots.any_free()
    assert slots.take() == 2 and not slots.any_free()


def test_no_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="need num_slots >= 1, got 0"):
        Slots(0)
