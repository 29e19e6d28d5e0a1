"""The pool holder's process: answer workers' ``AttachPool`` with their shared pool.

It binds a ROUTER at the run's holder endpoint and owns one pool per tensor-parallel rank (rank
0 alone for a worker of one rank), keyed by the rank in the request's geometry: a ``PoolFile``
for a CPU worker, a ``DevicePool`` (``holder.device_pool``) for a CUDA one. A
rank's first request creates its pool with the rank's geometry; later ones get the same pool,
its generation bumped, when their geometry is the same (rank and group size included; any block
count, if theirs came from a budget). It refuses, and says why, when the geometry differs, or
while the process that attached to that rank's pool last still maps it (two processes must never
write one pool). SIGTERM or SIGINT removes the files and exits 0; a SIGKILLed holder's files are
removed by the next holder of the run.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import zmq

from holder.device_pool import DevicePool, exited, started
from holder.pool_file import PoolFile, remove_stale
from protocol.channel import BadMessage, Channel
from protocol.kv_pool import PROTOCOL_VERSION, AttachPool, PoolGeometry, PoolGranted, ToHolder

log = logging.getLogger("nanoserve.holder")


def maps(pid: int, path: Path) -> bool:
    """Whether process ``pid`` still maps ``path``. A SIGKILLed process stops mapping anything
    as its exit detaches its memory, before the kernel tears that memory down (seconds, for a
    worker's gigabytes) and long before its parent reaps it: from then on it cannot write."""
    try:
        return str(path) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False  # no such process (or not ours to read: then it is not a worker of ours)


class Holder:
    """The pools, one per rank, and who attached to each last."""

    def __init__(self, run_id: str, directory: Path | None = None) -> None:
        self.run_id = run_id
        self.directory = directory
        self.pools: dict[int, PoolFile | DevicePool] = {}  # rank -> its pool
        self.attached_pids: dict[int, int] = {}  # rank -> the pid that attached to it last
        self.attached_starts: dict[int, int | None] = {}  # rank -> when that process started
        self._last_refusal: tuple[int, str] | None = None

    @property
    def pool(self) -> PoolFile | DevicePool | None:
        """Rank 0's pool: a worker of one rank's."""
        return self.pools.get(0)

    def attach(self, request: AttachPool) -> PoolGranted:
        """Grant a rank's pool to a worker, or say why not."""
        kind, refuse = self._refusal(request)
        if refuse:
            if (request.pid, kind) != self._last_refusal:  # a standby asks 50 times a second
                log.warning("pool refused to worker pid %d: %s", request.pid, refuse)
                self._last_refusal = (request.pid, kind)
            return PoolGranted(protocol_version=PROTOCOL_VERSION, reason=refuse, refusal=kind)
        rank = request.geometry.rank
        pool = self.pools.get(rank)
        if pool is None:
            try:
                pool = self.pools[rank] = self._create(request.geometry)
            except Exception as exc:  # no CUDA here, out of memory: the worker's pool is private
                why = f"cannot allocate {request.geometry.describe()}: {exc}"
                log.warning("pool refused to worker pid %d: %s", request.pid, why)
                return PoolGranted(protocol_version=PROTOCOL_VERSION, reason=why, refusal="alloc")
            log.info("pool %s created: %s", pool.pool_id, request.geometry.describe())
        device = isinstance(pool, DevicePool)
        try:
            handle = pool.export() if device else None
        except Exception as exc:
            why = f"cannot export pool {pool.pool_id}: {exc}"
            log.warning("pool refused to worker pid %d: %s", request.pid, why)
            return PoolGranted(protocol_version=PROTOCOL_VERSION, reason=why, refusal="export")
        generation = pool.attach()
        self.attached_pids[rank] = request.pid
        self.attached_starts[rank] = started(request.pid)
        log.info(
            "worker pid %d attached to pool %s%s, generation %d",
            request.pid,
            pool.pool_id,
            f" (rank {rank})" if request.geometry.world_size > 1 else "",
            generation,
        )
        return PoolGranted(
            protocol_version=PROTOCOL_VERSION,
            path="" if device else str(pool.path),
            pool_id=pool.pool_id,
            generation=generation,
            geometry=pool.geometry,
            device_handle=handle,
        )

    def _create(self, geometry: PoolGeometry) -> PoolFile | DevicePool:
        """A new pool of ``geometry``: in device memory for a CUDA worker, else a file."""
        if geometry.device != "cpu":
            return DevicePool(geometry)
        return PoolFile(self.run_id, geometry, self.directory)

    def _refusal(self, request: AttachPool) -> tuple[str, str]:
        """(kind, why) the pool is not granted; ("", "") when it is."""
        if request.protocol_version != PROTOCOL_VERSION:
            why = f"protocol {request.protocol_version}, the holder's {PROTOCOL_VERSION}"
            return "protocol", why
        rank = request.geometry.rank
        pool, previous = self.pools.get(rank), self.attached_pids.get(rank)
        if pool is None:
            return "", ""
        start = self.attached_starts.get(rank)
        if previous is not None and previous != request.pid and self._in_use(pool, previous, start):
            return "in_use", f"worker pid {previous} still maps the pool"
        have, want = pool.geometry, request.geometry
        if have.layout() != want.layout() or (
            have.num_blocks != want.num_blocks and not request.any_size
        ):
            return "geometry", f"the pool has {have.describe()}, this worker {want.describe()}"
        return "", ""

    @staticmethod
    def _in_use(pool: PoolFile | DevicePool, pid: int, start: int | None) -> bool:
        """Whether process ``pid`` (started at ``start``), which attached to ``pool`` last, may
        still write it: it maps the file; of a device pool, it has not exited
        (``holder.device_pool``)."""
        if isinstance(pool, DevicePool):
            return not exited(pid, start)
        return maps(pid, pool.path)

    def close(self) -> None:
        """Remove the pools' files, free the device pools."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def run_holder(*, address: str, run_id: str, poll_s: float = 0.2) -> int:
    """Serve ``AttachPool`` at ``address`` until SIGTERM or SIGINT; returns 0."""
    for path in remove_stale(run_id):
        log.warning("removed %s, left by a holder that was killed", path)
    holder = Holder(run_id)
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    channel: Channel = Channel(socket, ToHolder)
    log.info("pool holder pid %d at %s", os.getpid(), address)
    try:
        while not stopping:
            if not socket.poll(int(poll_s * 1000)):
                continue
            try:
                peer, message = channel.recv()
            except BadMessage as exc:
                log.warning("dropped a bad message: %s", exc)
                continue
            match message:
                case AttachPool():
                    channel.send(holder.attach(message), peer)
        return 0
    finally:
        holder.close()
        socket.close(0)
        context.term()
