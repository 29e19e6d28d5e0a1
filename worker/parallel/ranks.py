"""A tensor-parallel worker's ranks: rendezvous, the local ranks it starts, and their watch.

``nanoserve worker --tensor-parallel-size N`` runs one process per rank, in one torch.distributed
process group (gloo on CPU, NCCL on CUDA) that meets at a TCP store hosted by rank 0. The process
that runs the lowest rank of this host starts the host's other ranks as its children, each with
a parent-death signal (``PR_SET_PDEATHSIG``), so none outlives it whatever kills it. Rank 0 talks
to the scheduler (``worker.process``); the others follow it (``worker.parallel.steps``).

The death of any rank is the worker's death. Every rank beats a counter in the store each
``BEAT_S``, and a watch thread in every rank reads the others': a rank silent for
``timeout_s`` (dead, stopped, or hung with its threads), a local child that exited, or a store
that no longer answers ends this process at once (exit 1). Rank 0's exit closes its connection
to the scheduler, which then re-admits the requests as after any worker death, and the
supervisor restarts the whole group. The collectives' own timeout (``COLLECTIVE_TIMEOUT_S``) is
only the backstop: the watch acts within ``timeout_s``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from worker.parallel.config import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from worker.config import WorkerConfig
    from worker.parallel.group import DistributedGroup

log = logging.getLogger("nanoserve.worker")

BEAT_S = 0.25
COLLECTIVE_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def run_ranks(
    config: WorkerConfig,
    parallel: ParallelConfig,
    lead: Callable[[DistributedGroup], int],
    child: Callable[[int, int], tuple[list[str], dict[str, str]]],
    holder: str | None = None,
) -> int:
    """Run this host's first rank (starting the others): rank 0 runs ``lead(group)``, any other
    follows it. ``child(rank, port)`` is the command and environment of a local rank's process.
    ``holder``: the pool holder's address, where a rank asks for its pool (``--shared-kv-pool``)."""

    from worker.parallel.group import DistributedGroup
    from worker.plan import resolve_device

    rank, local = parallel.local_ranks[0], parallel.local_ranks
    # A rank started by its host's first rank runs alone in its process, but shares the host.
    local_size = int(os.environ.get("NANOSERVE_TP_LOCAL_SIZE", len(local)))
    device = resolve_device(config)
    if len(local) > 1:  # before any rank starts: refuse a size that does not fit, convert once
        check_fits(config, parallel.size)
    store = _store(parallel, rank)
    children = [
        _spawn(*child(other, store.port), index, len(local))
        for index, other in enumerate(local[1:], 1)
    ]
    try:
        _join(parallel, rank, store, device)
        watch = Watch(parallel, rank, store.port, children)
        watch.start()
        group = DistributedGroup(
            rank=rank, size=parallel.size, local_size=local_size, device=device, on_close=watch.stop
        )
        if rank == 0:
            return lead(group)
        code = _follow(config, group, holder)
        group.close()
        return code
    finally:
        _end(children)


def _join(parallel: ParallelConfig, rank: int, store: TCPStore, device: str) -> None:
    """Join the process group: NCCL on this host's GPU of this rank, else gloo (on loopback
    when every rank is here)."""
    import torch.distributed as dist

    from worker.plan import collective_backend

    backend = collective_backend(device, int(os.environ.get("NANOSERVE_TP_DEVICE_INDEX", "0")))
    if backend == "gloo" and parallel.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=max(COLLECTIVE_TIMEOUT_S, parallel.connect_timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=parallel.size, timeout=timeout
    )
    where = f"{parallel.master_addr}:{store.port}"
    log.info("rank %d of %d joined (%s, store %s)", rank, parallel.size, backend, where)


def check_fits(config: WorkerConfig, size: int) -> None:
    """ValueError, in one line, if ``size`` ranks cannot split the model's heads evenly. It
    reads the model's config, converting a GGUF file first, so the ranks started next find the
    conversion cached."""
    from models.files import resolve_model
    from worker.model.llama import ModelSpec
    from worker.model.loader import load_config
    from worker.parallel.sharding import Shard

    Shard.of(ModelSpec.from_config(load_config(resolve_model(config.model))), 0, size)


def _follow(config: WorkerConfig, group: DistributedGroup, holder: str | None) -> int:
    """A rank other than 0: build its share of the worker (its pool the holder's at ``holder``,
    with ``--shared-kv-pool``), then follow the leader."""
    from worker.parallel.steps import follow
    from worker.worker import Worker

    if os.environ.get("NANOSERVE_TP_SPAWNED"):  # the leader ends it: Shutdown, or its death
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    return follow(Worker(config, progress=False, group=group, holder=holder))


def _store(parallel: ParallelConfig, rank: int) -> TCPStore:
    """Rank 0 hosts the TCP store (on a free port when ``master_port`` is 0); the others
    connect. ValueError with one line when the store cannot be reached in time."""
    from torch.distributed import TCPStore

    if rank != 0:  # torch's client logs a C++ trace per retry: knock first, for one clean line
        _wait_reachable(parallel.master_addr, parallel.master_port, parallel.connect_timeout_s)
    try:
        return TCPStore(
            parallel.master_addr,
            parallel.master_port,
            parallel.size,
            rank == 0,
            timeout=timedelta(seconds=parallel.connect_timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        where = f"{parallel.master_addr}:{parallel.master_port}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"tensor parallel rendezvous at {where} failed: {first}") from None


def _wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a connection; ValueError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            ):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"tensor parallel rendezvous at {host}:{port} failed: nothing answered "
                    f"within {timeout_s:g} s ({exc.strerror or exc})"
                ) from None
            time.sleep(0.2)


def _spawn(command: list[str], env: dict[str, str], index: int, here: int) -> subprocess.Popen:
    """Start a local rank that dies with this process (SIGKILL on its parent's death), on this
    host's ``index``-th GPU where there are GPUs; ``here`` ranks share this host."""
    parent = os.getpid()

    def die_with_parent() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: follow it now
            os._exit(1)

    env = {**env, "NANOSERVE_TP_SPAWNED": "1", "NANOSERVE_TP_DEVICE_INDEX": str(index)}
    env["NANOSERVE_TP_LOCAL_SIZE"] = str(here)
    return subprocess.Popen(command, env=env, preexec_fn=die_with_parent)


def _end(children: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Wait (bounded) for the local ranks to exit after a Shutdown; SIGKILL what lingers."""
    deadline = time.monotonic() + grace_s
    for process in children:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Watch(threading.Thread):
    """Beats this rank's counter in the store, and ends the process when another rank goes
    silent for ``timeout_s``, a local child exits, or the store stops answering."""

    def __init__(self, parallel: ParallelConfig, rank: int, port: int, children: list) -> None:
        super().__init__(name="rank-watch", daemon=True)
        self.parallel, self.rank, self.port, self.children = parallel, rank, port, children
        self.stopped = threading.Event()

    def stop(self) -> None:
        """The group is closing on purpose: ranks that leave from now on are no fault."""
        self.stopped.set()

    def run(self) -> None:
        from torch.distributed import TCPStore

        parallel = self.parallel
        try:  # a client of its own: the process group's store is the main thread's
            store = TCPStore(
                parallel.master_addr,
                self.port,
                is_master=False,
                timeout=timedelta(seconds=parallel.timeout_s),
            )
        except (RuntimeError, OSError) as exc:
            return self._die(f"cannot reach the group's store: {exc}")
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last moved)
        while not self.stopped.wait(BEAT_S):
            why = self._check(store, seen)
            if why is not None:
                return self._die(why)

    def _check(self, store, seen: dict[int, tuple[int, float]]) -> str | None:
        """Beat once and look at the others; returns what is wrong, if anything."""
        now = time.monotonic()
        try:
            store.add(f"beat/{self.rank}", 1)
            others = [r for r in range(self.parallel.size) if r != self.rank]
            counts = {other: store.add(f"beat/{other}", 0) for other in others}
        except (RuntimeError, OSError):
            return "the group's store stopped answering (rank 0 is gone or hung)"
        for other, count in counts.items():
            last = seen.get(other)
            if last is None or last[0] != count:
                seen[other] = (count, now)
            elif now - last[1] > self.parallel.timeout_s:
                return f"rank {other} silent for {now - last[1]:.1f} s"
        for process in self.children:
            if process.poll() is not None:
                return f"local rank (pid {process.pid}) exited with {process.returncode}"
        return None

    def _die(self, why: str) -> None:
        """The group is broken: end this rank and its local children now."""
        if self.stopped.is_set():
            return
        log.error("rank %d: %s: the worker's ranks stop together", self.rank, why)
        for process in self.children:
            if process.poll() is None:
                process.kill()
        sys.stderr.flush()
        os._exit(1)
