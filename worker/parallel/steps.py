"""How the ranks of a tensor-parallel worker share the scheduler's messages.

Rank 0 (the leader) alone talks to the scheduler. Each message that changes the ranks' state
goes to the others as msgspec bytes (``Group.send_message``), in the scheduler's own union
(``SchedulerToWorker``), before the leader acts on it:

- a ``StepInput``, with every ``PENDING_TOKEN`` replaced by the token the leader sampled for
  that row in its previous step (only the leader samples, so only it knows that token);
- a ``SchedulerHello``: empty every row (a new scheduler, or a refused step);
- a ``Shutdown``: the other ranks exit 0.

Every rank then runs the same step on identical rows, so they refuse the same steps too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from protocol.messages import (
    PENDING_TOKEN,
    SchedulerHello,
    SchedulerToWorker,
    Shutdown,
    StepInput,
    StepItem,
)
from worker.parallel.group import Group
from worker.rows import RowTable

if TYPE_CHECKING:
    from worker.worker import Worker

log = logging.getLogger("nanoserve.worker")
_ENCODER = msgspec.msgpack.Encoder()


def lead(group: Group, step: StepInput, rows: RowTable) -> StepInput:
    """Share ``step`` with the other ranks, its pending tokens resolved; returns what was sent."""
    released = set(step.released_slots)
    items = [_resolved(item, rows, released) for item in step.items]
    if any(new is not old for new, old in zip(items, step.items, strict=True)):
        step = msgspec.structs.replace(step, items=items)
    group.send_message(_ENCODER.encode(step))
    return step


def _resolved(item: StepItem, rows: RowTable, released: set[int]) -> StepItem:
    """``item`` with its pending token replaced by the row's last sample, where there is one
    (otherwise unchanged, and every rank's check refuses it alike)."""
    if not item.token_ids or item.token_ids[0] != PENDING_TOKEN or item.slot in released:
        return item
    if not 0 <= item.slot < len(rows.rows):
        return item
    token = rows.rows[item.slot].last_sampled  # a draft item's drafts follow it unchanged
    if token is None:
        return item
    return msgspec.structs.replace(item, token_ids=[token, *item.token_ids[1:]])


def lead_reset(group: Group) -> None:
    """Have every other rank empty its rows."""
    group.send_message(_ENCODER.encode(SchedulerHello()))


def lead_shutdown(group: Group) -> None:
    """Have every other rank exit."""
    group.send_message(_ENCODER.encode(Shutdown(reason="the leader stopped")))


def follow(worker: Worker) -> int:
    """A rank other than 0: run what the leader shares until it says Shutdown; returns 0. A
    worker whose group's collectives fail (a rank died, or timed out) raises out of here, and
    the process exits."""
    decoder = msgspec.msgpack.Decoder(SchedulerToWorker)
    group = worker.group
    while True:
        payload = group.receive_message()
        if payload is None:
            continue  # a keepalive
        match decoder.decode(payload):
            case StepInput() as step:
                try:
                    worker.execute(step)
                except ValueError as exc:  # the leader refuses it too, and resets everyone
                    log.warning("rank %d: step %d refused: %s", group.rank, step.step_id, exc)
            case SchedulerHello():
                worker.reset()
            case Shutdown():
                return 0
