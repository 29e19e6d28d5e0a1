"""Slots: the ledger of the worker's cache rows, one for each running request.

A slot is free or held by exactly one running request (the auditor checks both ways). A freed
slot's row still holds its last tenant's block table on the worker until the next step empties
it: the slot waits in ``pending_releases`` until ``schedule()`` hands it to that step. Free slots
are taken lowest first, so a lightly loaded worker keeps using its first rows.
"""

from __future__ import annotations

import heapq


class Slots:
    """The free slots (a heap) and the releases the worker has not been told of."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self._pending: list[int] = []  # freed since the last step was planned

    @property
    def free(self) -> list[int]:
        """The free slot ids, sorted (duplicates kept, so the auditor can see them)."""
        return sorted(self._free)

    @property
    def pending_releases(self) -> tuple[int, ...]:
        """Slots freed since the last ``take_releases``; the next step empties their rows."""
        return tuple(self._pending)

    def any_free(self) -> bool:
        """True while a slot is free."""
        return bool(self._free)

    def take(self) -> int:
        """The lowest free slot, now held."""
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        """A held slot is free again; its row is emptied with the next step."""
        heapq.heappush(self._free, slot)
        self._pending.append(slot)

    def release_all(self) -> None:
        """Every row is to be emptied with the next step (their contents can no longer be
        trusted), free or not."""
        self._pending = list(range(self.num_slots))

    def take_releases(self) -> list[int]:
        """The slots whose rows the step being planned empties first."""
        released, self._pending = self._pending, []
        return released
