"""``BlockTables``: every slot's block table, kept on the device and updated in place.

A captured decode step (``worker.step.graphs``) reads its rows' block tables from a persistent
buffer. Building each row's whole table on the host every step would cost time and bytes in
proportion to the contexts; instead the tables live on the device, (num_slots + 1, width), and
each step sends only what changed: the blocks its items join to their rows (``pack_updates``),
which ``apply`` writes before the forward. A fresh row first fills its whole line with its first
block, so the columns past its last block point at K/V that some step has written (a padded
read of a never-written block could be NaN, which a zero attention weight does not cancel).

The extra line, ``trash_row``, is all trash block: the padding rows of a bucket read it.
"""

from __future__ import annotations

import torch

from protocol.blocks import blocks_for
from protocol.messages import StepItem
from worker.rows import Row
from worker.step.pack import HostPack, Packed


class BlockTables:
    """(num_slots + 1, width) int64 block ids on ``device``; the last line is the trash row."""

    def __init__(
        self, *, num_slots: int, max_model_len: int, block_size: int, trash_block: int, device
    ) -> None:
        self.width = blocks_for(max_model_len, block_size)
        self.trash_row = num_slots
        shape = (num_slots + 1, self.width)
        self.tables = torch.full(shape, trash_block, dtype=torch.long, device=device)

    def pack_updates(self, pack: HostPack, items: list[StepItem], rows: list[Row]) -> None:
        """Add what the step's items change (names ``t.*``): each fresh row's first block, and
        every block joined, at its column."""
        fill_slot, fill_block, slot, column, block = [], [], [], [], []
        for item, row in zip(items, rows, strict=True):
            if not item.new_blocks:
                continue
            if item.fresh:
                fill_slot.append(item.slot)
                fill_block.append(row.block_table[0])
            first = len(row.block_table) - len(item.new_blocks)
            slot.extend([item.slot] * len(item.new_blocks))
            column.extend(range(first, len(row.block_table)))
            block.extend(item.new_blocks)
        pack.add("t.fill_slot", fill_slot)
        pack.add("t.fill_block", fill_block)
        pack.add("t.slot", slot)
        pack.add("t.column", column)
        pack.add("t.block", block)

    def apply(self, packed: Packed) -> None:
        """Write what ``pack_updates`` packed."""
        fill = packed["t.fill_slot"]
        if fill.numel():
            self.tables[fill] = packed["t.fill_block"][:, None].expand(-1, self.width)
        self.tables[packed["t.slot"], packed["t.column"]] = packed["t.block"]
