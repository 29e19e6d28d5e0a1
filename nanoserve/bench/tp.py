"""``nanoserve bench tp``: the decode step time of a worker of 1, 2, 3... ranks, and what its
all-reduces cost.

For each size, one process per rank (spawned, gloo on loopback) builds its share of the worker;
rank 0 runs the steps of ``nanoserve bench forward`` (one prefill of ``batch`` rows, then decode
steps) through the real path, sharing each step with the others, while they follow it. Rank 0
times every all-reduce: the cost per step includes waiting for the slowest rank, which is what
a step pays for it.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from protocol.blocks import blocks_for
from worker.parallel.group import SOLO, DistributedGroup

if TYPE_CHECKING:
    import torch

    from worker.worker import Worker


@dataclass(frozen=True)
class TpRow:
    """One size's figures, in seconds per decode step."""

    size: int
    decode_step_s: float
    all_reduce_s: float
    all_reduces: int  # per decode step


class TimedGroup(DistributedGroup):
    """A ``DistributedGroup`` that sums the time its all-reduces take."""

    seconds = 0.0
    calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        out = super().all_reduce(x)
        self.seconds += time.perf_counter() - began
        self.calls += 1
        return out


def bench_tp(
    *, model: str | None, dtype: str, sizes: list[int], batch: int, context: int, steps: int
) -> list[TpRow]:
    """Run every size in turn; returns one row per size."""
    import torch.multiprocessing as mp

    rows = []
    spawn = mp.get_context("spawn")
    for size in sizes:
        queue = spawn.SimpleQueue()
        settings = dict(model=model, dtype=dtype, batch=batch, context=context, steps=steps)
        port = _free_port()
        ranks = [
            spawn.Process(target=_rank, args=(rank, size, port, settings, queue), daemon=True)
            for rank in range(size)
        ]
        for process in ranks:
            process.start()
        try:
            rows.append(queue.get())
        finally:
            for process in ranks:
                process.join(30.0)
                if process.is_alive():
                    process.kill()
    return rows


def _rank(rank: int, size: int, port: int, settings: dict, queue) -> None:
    """One rank: join the group, build its share, and lead (rank 0) or follow the steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from worker.config import WorkerConfig
    from worker.parallel.steps import follow
    from worker.worker import Worker

    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    group = TimedGroup(rank=rank, size=size, local_size=size, device="cpu")
    if size > 1:  # one rank runs as the worker always has: no process group, no collectives
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=120)
        store = TCPStore(
            "127.0.0.1", port, size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        group = SOLO
    batch, context, steps = settings["batch"], settings["context"], settings["steps"]
    per_row = blocks_for(context + steps + 2, 16)
    config = WorkerConfig(
        model=settings["model"],
        dtype=settings["dtype"],
        num_blocks=batch * per_row,
        num_slots=batch,
        max_model_len=per_row * 16,
    )
    worker = Worker(config, progress=False, group=group)
    if rank:
        follow(worker)
    else:
        queue.put(_lead(worker, group, batch, context, steps, per_row))
        worker.close()


def _lead(
    worker: Worker, group: TimedGroup, batch: int, context: int, steps: int, per_row: int
) -> TpRow:
    """Rank 0's measurement: a prefill, one warm-up decode, then ``steps`` timed decodes."""
    from nanoserve.bench.forward import DecodeLoop, prefill_step

    result = worker.execute(prefill_step(batch, context, per_row, worker.spec.vocab_size))
    decoder = DecodeLoop(worker, batch, context, result)
    decoder.step()
    group.seconds, group.calls = 0.0, 0
    times = [decoder.step() for _ in range(steps)]
    seconds, calls = getattr(group, "seconds", 0.0), getattr(group, "calls", 0)
    return TpRow(group.size, statistics.median(times), seconds / steps, calls // steps)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def format_table(rows: list[TpRow], batch: int) -> str:
    """A Markdown table of the results."""
    lines = [
        f"| ranks | decode step, batch {batch} (ms) | all-reduce per step (ms) | all-reduces |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.size} | {row.decode_step_s * 1000:.1f} | {row.all_reduce_s * 1000:.2f} "
            f"| {row.all_reduces} |"
        )
    return "\n".join(lines)
