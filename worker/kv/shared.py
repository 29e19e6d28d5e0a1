"""Attach to the pool holder's shared K/V pool, or say why the pool stays private.

The worker asks the holder (``holder/``) once, as it sizes its cache: a grant is a file in
/dev/shm, mapped shared, whose header must match the grant (geometry, pool id, generation)
before a byte of it is trusted. Anything else (no holder answering, another geometry, a pool
another live worker maps, a bad header) is a fallback: the worker allocates its pool privately,
as without a holder, and ``reason`` says why in one log line (``fallback``, its kind, is a
label on the scheduler's metric).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass

import zmq

from protocol.channel import BadMessage, Channel
from protocol.kv_pool import (
    HEADER_BYTES,
    PROTOCOL_VERSION,
    AttachPool,
    FromHolder,
    PoolGeometry,
    pool_bytes,
    unpack_header,
)
from protocol.messages import StepInput

ATTACH_TIMEOUT_S = 2.0
STANDBY_POLL_S = 0.02  # a standby asks this often: the holder answers from /proc, in microseconds

log = logging.getLogger("nanoserve.worker")


@dataclass(frozen=True)
class Attachment:
    """A shared pool (``mapping``, its id, generation and geometry) or why there is none."""

    mapping: mmap.mmap | None = None
    pool_id: str = ""
    generation: int = 0
    geometry: PoolGeometry | None = None
    fallback: str = ""  # the kind of reason: "no_holder", "geometry", "in_use", "header", ...
    reason: str = ""

    @property
    def reused(self) -> bool:
        """Whether an earlier worker attached to this pool (its blocks may hold K/V)."""
        return self.mapping is not None and self.generation > 1


def private(fallback: str, reason: str) -> Attachment:
    """No shared pool, for this reason."""
    return Attachment(fallback=fallback, reason=reason)


def attach(
    address: str,
    geometry: PoolGeometry,
    any_size: bool,
    timeout_s: float = ATTACH_TIMEOUT_S,
    standby: bool = False,
) -> Attachment:
    """Ask the holder at ``address`` for a pool of ``geometry`` and map it. ``standby``: while
    another live worker maps the pool, wait (asking every ``STANDBY_POLL_S``) and take it over
    once that worker is gone, instead of falling back to a private pool."""
    waited = False
    while True:
        result = _attach_once(address, geometry, any_size, timeout_s)
        if not standby or result.fallback != "in_use":
            return result
        if not waited:
            log.info("standby: the model is loaded; waiting to take the KV pool over")
            waited = True
        time.sleep(STANDBY_POLL_S)


def _attach_once(
    address: str, geometry: PoolGeometry, any_size: bool, timeout_s: float
) -> Attachment:
    """One ``AttachPool`` and its answer, mapped."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        channel: Channel = Channel(socket, FromHolder)
        request = AttachPool(
            protocol_version=PROTOCOL_VERSION, geometry=geometry, pid=os.getpid(), any_size=any_size
        )
        channel.send(request)
        if not socket.poll(int(timeout_s * 1000)):
            return private("no_holder", f"no pool holder answered at {address} in {timeout_s} s")
        try:
            _, grant = channel.recv()
        except BadMessage as exc:
            return private("protocol", f"the holder's answer is unreadable: {exc}")
    finally:
        socket.close(0)
    if not grant.path or grant.geometry is None:
        return private(grant.refusal or "refused", f"the holder refused: {grant.reason}")
    return _map(grant.path, grant.geometry, grant.pool_id, grant.generation, geometry, any_size)


def _map(
    path: str,
    granted: PoolGeometry,
    pool_id: str,
    generation: int,
    asked: PoolGeometry,
    any_size: bool,
) -> Attachment:
    """Map the granted file and check its header against the grant and what was asked."""
    if granted.layout() != asked.layout() or (
        granted.num_blocks != asked.num_blocks and not any_size
    ):
        return private("geometry", f"granted {granted.describe()}, asked {asked.describe()}")
    size = HEADER_BYTES + pool_bytes(granted)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return private("header", f"cannot open {path}: {exc}")
    try:
        if os.fstat(fd).st_size != size:
            return private("header", f"{path} has {os.fstat(fd).st_size} bytes, not {size}")
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    try:
        header = unpack_header(mapping[:HEADER_BYTES])
    except ValueError as exc:
        mapping.close()
        return private("header", f"{path}: {exc}")
    if header != (granted, pool_id, generation):
        mapping.close()
        return private("header", f"{path}'s header {header} is not the grant's")
    return Attachment(mapping=mapping, pool_id=pool_id, generation=generation, geometry=granted)


def partial_ranges(step: StepInput, applied: list, block_size: int) -> list[tuple[int, int, int]]:
    """(block, first slot, end slot) for each item of ``step`` whose tokens end inside a block:
    the slots it writes into the row's last, partial block, which the worker sums on a shared
    pool (a block it fills is summed whole: ``filled_blocks``)."""
    ranges = []
    for item, (row, _) in zip(step.items, applied, strict=True):
        end = item.start + len(item.token_ids)
        if end % block_size:
            first = max(item.start, end - end % block_size) % block_size
            ranges.append((row.block_table[end // block_size], first, end % block_size))
    return ranges


def filled_blocks(step: StepInput, applied: list, block_size: int) -> list[int]:
    """The blocks each item of ``step`` fills (its tokens reach their last position): those the
    worker sums on a shared pool."""
    filled = []
    for item, (row, _) in zip(step.items, applied, strict=True):
        end = item.start + len(item.token_ids)
        for index in range(item.start // block_size, end // block_size):
            filled.append(row.block_table[index])
    return filled
