"""Attach to the pool holder's shared K/V pool, or say why the pool stays private.

The worker asks the holder (``holder/``) once, as it sizes its cache: a grant is a file in
/dev/shm, mapped shared, whose header must match the grant (geometry, pool id, generation)
before a byte of it is trusted, or, for a CUDA worker, device memory opened through the
holder's IPC handle (``worker.kv.device_pool``). Anything else (no holder answering, another
geometry, a pool another live worker maps, a bad header) is a fallback: the worker allocates
its pool privately, as without a holder, and ``reason`` says why in one log line
(``fallback``, its kind, is a label on the scheduler's metric).

A tensor-parallel group attaches as a group: each rank asks for its own rank's pool (its share
of the KV heads), then the ranks tell each other what they got (``agree``). The group's pools
are shared only if every rank's is, all of one block count; else every rank's pool is private.
The leader then maps the other ranks' pools read-only (``PeerPools``): the checksum of a block
it reports covers every rank's shard.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from protocol.channel import BadMessage, Channel
from protocol.kv_pool import (
    HEADER_BYTES,
    PROTOCOL_VERSION,
    AttachPool,
    FromHolder,
    PoolGeometry,
    element_size,
    pool_bytes,
    unpack_header,
)
from worker.kv.device_pool import open_granted

if TYPE_CHECKING:
    from worker.parallel.group import Group

# A holder started beside the worker (``serve --shared-kv-pool``, a Procfile) may bind its socket
# after the worker has loaded its model, on a loaded machine seconds after: the worker waits this
# long for the socket to appear, then this long for the answer of a holder that has bound it
# (from /proc, microseconds; a holder restarting on a stale socket file, a supervisor's backoff).
HOLDER_START_S = 30.0
ATTACH_TIMEOUT_S = 5.0
# A holder's first device pool comes after it imports torch, starts CUDA and zeroes the pool.
DEVICE_ATTACH_TIMEOUT_S = 60.0
_SOCKET_POLL_S = 0.02
STANDBY_POLL_S = 0.02  # a standby asks this often: the holder answers from /proc, in microseconds
# A restarted group's rank waits this long for the lost group's rank to stop mapping its pool:
# the lost ranks end within their watch's timeout (``worker.parallel.ranks``), seconds.
RANK_WAIT_S = 15.0

log = logging.getLogger("nanoserve.worker")


@dataclass(frozen=True)
class Attachment:
    """A shared pool (``mapping``, the file's, or ``device_pool``, the bytes of a CUDA pool; its
    id, generation and geometry) or why there is none."""

    mapping: mmap.mmap | None = None
    pool_id: str = ""
    generation: int = 0
    geometry: PoolGeometry | None = None
    fallback: str = ""  # the kind of reason: "no_holder", "geometry", "in_use", "header", ...
    reason: str = ""
    path: str = ""  # the pool's file
    ranks: tuple[RankPool, ...] = ()  # a group's: what every rank attached, rank 0 first
    device_pool: object | None = None  # a CUDA pool's bytes: a flat uint8 torch tensor

    @property
    def shared(self) -> bool:
        """Whether the pool is the holder's (a file mapped, or device memory opened)."""
        return self.mapping is not None or self.device_pool is not None

    @property
    def reused(self) -> bool:
        """Whether an earlier worker attached to this pool (its blocks may hold K/V): of a
        group, to every rank's."""
        others = all(rank.generation > 1 for rank in self.ranks)
        return self.shared and self.generation > 1 and others


class RankPool(msgspec.Struct, array_like=True, gc=False, frozen=True, kw_only=True):
    """What one rank of a group attached, as the ranks tell each other (``agree``)."""

    path: str = ""
    pool_id: str = ""
    generation: int = 0
    geometry: PoolGeometry | None = None
    fallback: str = ""
    reason: str = ""


def private(fallback: str, reason: str) -> Attachment:
    """No shared pool, for this reason."""
    return Attachment(fallback=fallback, reason=reason)


def attach(
    address: str,
    geometry: PoolGeometry,
    any_size: bool,
    timeout_s: float = ATTACH_TIMEOUT_S,
    standby: bool = False,
    wait_s: float = 0.0,
    start_s: float = HOLDER_START_S,
) -> Attachment:
    """Ask the holder at ``address`` for a pool of ``geometry`` and map it, once its socket is
    there (within ``start_s``; then an answer within ``timeout_s``). ``standby``: while another
    live worker maps the pool, wait (asking every ``STANDBY_POLL_S``) and take it over once that
    worker is gone, instead of falling back to a private pool; ``wait_s``: the same, for that
    many seconds at most (a restarted group's rank, ``RANK_WAIT_S``)."""
    if not _socket_appears(address, start_s):
        return private("no_holder", f"no pool holder at {address} after {start_s} s")
    waited = False
    deadline = time.monotonic() + wait_s
    while True:
        result = _attach_once(address, geometry, any_size, timeout_s)
        if result.fallback != "in_use" or not (standby or time.monotonic() < deadline):
            return result
        if standby and not waited:
            log.info("standby: the model is loaded; waiting to take the KV pool over")
            waited = True
        time.sleep(STANDBY_POLL_S)


def _socket_appears(address: str, start_s: float) -> bool:
    """Whether the holder's ipc socket exists, waiting up to ``start_s`` for it."""
    path = address.removeprefix("ipc://")
    if path == address:  # not an ipc address: the answer's timeout alone bounds the wait
        return True
    deadline = time.monotonic() + start_s
    if not os.path.exists(path):
        log.info("waiting for the pool holder at %s (up to %.0f s)", address, start_s)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(_SOCKET_POLL_S)
    return True


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
    if grant.geometry is None or not (grant.path or grant.device_handle):
        return private(grant.refusal or "refused", f"the holder refused: {grant.reason}")
    if grant.device_handle is not None:
        return open_granted(grant, geometry, any_size)
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
    return Attachment(
        mapping=mapping, pool_id=pool_id, generation=generation, geometry=granted, path=path
    )


def agree(group: Group, mine: Attachment) -> Attachment:
    """A group's attach (every rank calls it, with what it attached): the group's pools are
    shared if every rank's is, all of one block count, and ``ranks`` then says what each rank
    attached; else every rank drops its mapping, and the first failing rank's reason is the
    group's."""
    report = RankPool(
        path=mine.path,
        pool_id=mine.pool_id,
        generation=mine.generation,
        geometry=mine.geometry,
        fallback=mine.fallback,
        reason=mine.reason,
    )
    decoder = msgspec.msgpack.Decoder(RankPool)
    ranks = [decoder.decode(b) for b in group.all_gather_bytes(msgspec.msgpack.encode(report))]
    failed = [(rank, pool) for rank, pool in enumerate(ranks) if pool.geometry is None]
    why = ("", "")
    if failed:
        rank, pool = failed[0]
        why = (pool.fallback, f"rank {rank}: {pool.reason}")
    elif len({pool.geometry.num_blocks for pool in ranks}) > 1:
        counts = ", ".join(f"rank {r}: {pool.geometry.num_blocks}" for r, pool in enumerate(ranks))
        why = ("geometry", f"the ranks' pools differ in blocks ({counts})")
    if why[0] or why[1]:
        if mine.mapping is not None:
            mine.mapping.close()  # no tensor views it yet
        return private(why[0] or "refused", why[1])
    return replace(mine, ranks=tuple(ranks))


class PeerPools:
    """The leader's read-only maps of the other ranks' pools (every rank on this host), so
    that a block's checksum covers every rank's shard of its K/V."""

    def __init__(self, ranks: tuple[RankPool, ...], own: int) -> None:
        self._mappings: list[mmap.mmap] = []
        self.pools: list[np.ndarray] = []  # per other rank: (L, 2, H, blocks + 1, block bytes)
        for rank, pool in enumerate(ranks):
            if rank != own:
                self._open(rank, pool)

    def _open(self, rank: int, pool: RankPool) -> None:
        g = pool.geometry
        if g is None:  # ``agree`` shares only pools that every rank has
            raise RuntimeError(f"rank {rank} has no shared pool: {pool.reason}")
        size = HEADER_BYTES + pool_bytes(g)
        fd = os.open(pool.path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        header = unpack_header(mapping[:HEADER_BYTES])
        if header != (g, pool.pool_id, pool.generation):
            mapping.close()
            raise RuntimeError(f"rank {rank}'s pool {pool.path}: header {header} is not its grant")
        self._mappings.append(mapping)
        self.block_size = g.block_size
        block_bytes = g.block_size * g.head_dim * element_size(g.dtype)  # of one head
        flat = np.frombuffer(mapping, dtype=np.uint8, count=pool_bytes(g), offset=HEADER_BYTES)
        shape = (g.num_layers, 2, g.n_kv_heads, g.num_blocks + 1, block_bytes)
        self.pools.append(flat.reshape(shape))

    def checksum(self, block: int, crc: int) -> int:
        """``crc`` (of the leader's shard) continued over every other rank's shard of
        ``block``, in rank order."""
        for pool in self.pools:
            crc = zlib.crc32(np.ascontiguousarray(pool[:, :, :, block]), crc)
        return crc

    def range_checksum(self, block: int, first: int, end: int, crc: int) -> int:
        """``crc`` (of the leader's slots ``[first, end)`` of ``block``) continued over every
        other rank's shard of those slots, rank by rank, slot by slot (as the leader's own)."""
        for pool in self.pools:
            slot = pool.shape[-1] // self.block_size  # bytes of one slot of one head
            for at in range(first, end):
                piece = pool[:, :, :, block, at * slot : (at + 1) * slot]  # (L, 2, H, slot)
                crc = zlib.crc32(np.ascontiguousarray(piece), crc)
        return crc
