"""``StepInputs``: one step's forward, flattened on the host into the step's pack, and put back
together on the device from the pack's views.

Every item's tokens go end to end (``ids``), with their positions; a pending token
(``PENDING_TOKEN``) is a 0 there and names its slot in ``feed``, and the device puts the
slot's latest sample in its place (``DeviceSampler.fed``): the host never needs that token. A
step that fits a decode graph (``worker.step.graphs``) is padded to its bucket and carries its rows'
slots, cached lengths and write positions; any other carries its attention metadata, built on
the host (``AttentionBackend.metadata``) and packed tensor by tensor (``add_tree``), so the
whole step still crosses in one copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from protocol.messages import PENDING_TOKEN, StepItem
from worker.attention import AttentionBackend, AttentionMetadata
from worker.rows import Row
from worker.shapes import padded_count
from worker.step.graphs import DecodeGraphs, Key
from worker.step.pack import HostPack, Packed


@dataclass
class StepInputs:
    """What the host knows of one step's forward."""

    num_tokens: int  # T: the real tokens
    sampled: list[int]  # (S,) each sampled position: an item's last, and before each draft
    pending: bool  # some token is fed on the device
    key: Key | None  # the decode graph it replays, or None: eager
    meta: AttentionMetadata | None = None  # eager: built on the host, packed as ``m.*``

    @classmethod
    def pack(
        cls,
        pack: HostPack,
        items: list[StepItem],
        applied: list[tuple[Row, list[int]]],
        *,
        attention: AttentionBackend,
        trash_block: int,
        graphs: DecodeGraphs | None,
    ) -> StepInputs:
        """Flatten the step's items (each with its (row, tokens) from ``RowTable.apply``) into
        ``pack`` (``x.*``, and ``g.*`` or ``m.*``)."""
        ids, feed, positions, sampled, spans = [], [], [], [], []
        pending = False
        for item, (row, tokens) in zip(items, applied, strict=True):
            if tokens[0] == PENDING_TOKEN:  # alone, or before draft tokens
                pending = True
                feed.extend([-1] * (len(ids) - len(feed)))
                feed.append(item.slot)
                ids.append(0)
                ids.extend(tokens[1:])
            else:
                ids.extend(tokens)
            positions.extend(range(item.start, item.start + len(tokens)))
            if item.sample:  # the last position, and the one before each draft token
                sampled.extend(range(len(ids) - 1 - item.num_draft, len(ids)))
            spans.append((row.block_table, item.start, len(tokens)))
        rows = [row for row, _ in applied]
        key = graphs.choose(items) if graphs is not None else None
        inputs = cls(len(ids), sampled, pending, key)
        if key is not None:
            graphs.pack(pack, items, rows, key)
            padded = key[0]
        else:
            # Padding tokens (id 0 at position 0) fill the step up to its bucketed size
            # (worker.shapes); the metadata sends their K/V to the trash block.
            groups = [item.num_draft > 0 for item in items]  # a token and its drafts
            inputs.meta = attention.metadata(
                spans, trash_block=trash_block, device="cpu", groups=groups
            )
            add_tree(pack, "m", inputs.meta)
            padded = inputs.meta.num_tokens
        padding = padded - len(ids)
        pack.add("x.ids", ids + [0] * padding)
        pack.add("x.positions", positions + [0] * padding)
        if pending:
            pack.add("x.feed", feed + [-1] * (padded - len(feed)))
        # The lm head's rows: copies of the first sampled row fill them up to a bucket too.
        head = sampled + sampled[:1] * (padded_count(len(sampled)) - len(sampled))
        pack.add("x.sampled", head)
        return inputs

    def metadata(self, packed: Packed) -> AttentionMetadata:
        """The eager step's metadata, its tensors the pack's device views."""
        return rebuild_tree(packed, "m", self.meta)


def add_tree(pack: HostPack, prefix: str, tree: object) -> None:
    """Add every tensor of ``tree`` (dataclasses, named tuples and lists of them) to ``pack``,
    named ``prefix.0``, ``prefix.1``... in the order ``rebuild_tree`` reads them back."""
    for index, tensor in enumerate(_tensors(tree)):
        pack.add(f"{prefix}.{index}", tensor.contiguous())


def rebuild_tree(packed: Packed, prefix: str, tree):
    """``tree`` with each of its tensors replaced by the pack's device view of it."""
    views = (packed[f"{prefix}.{index}"] for index in range(len(list(_tensors(tree)))))
    return _rebuilt(tree, views)


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif dataclasses.is_dataclass(tree):
        for field in dataclasses.fields(tree):
            yield from _tensors(getattr(tree, field.name))
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _rebuilt(tree, views: Iterator[torch.Tensor]):
    if isinstance(tree, torch.Tensor):
        return next(views)
    if dataclasses.is_dataclass(tree):
        fields = {f.name: _rebuilt(getattr(tree, f.name), views) for f in dataclasses.fields(tree)}
        return dataclasses.replace(tree, **fields)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_rebuilt(value, views) for value in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuilt(value, views) for value in tree)
    return tree
