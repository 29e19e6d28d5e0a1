"""Where the frontend and the scheduler run: on the last CPU this process may use.

Both wake for every token (a ZeroMQ message in, one or two out, an SSE write) and work for
some hundred microseconds each time, on the cores the worker's threads are stepping on. Left
to the kernel, each wake-up lands on whichever core it picks and preempts whichever worker
thread runs there, and the process migrates between cores with cold caches. On one fixed
CPU they always meet the same worker thread, and keep their caches. Measured on a 2-core
machine at concurrency 1 (docs/performance.md): the inter-token latency, over llama.cpp's
server's in the same rounds, 3-8% lower on average in four sets of alternating starts; the
machine's drift is of that size, and one set's medians went the other way.

Several frontends (``--api-servers``) each get a CPU of their own, counted down from the last
(``frontend_offset``): below the scheduler's where the CPUs leave the worker at least one.

The worker is not pinned: beside a CPU-bound neighbour its thread governor drops to one
thread, and that thread must be free to run on whichever core the neighbour leaves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def frontend_offset(index: int, count: int, num_cpus: int) -> int:
    """How many CPUs below the last one frontend ``index`` of ``count`` runs on. One frontend
    shares the last CPU with the scheduler. Several take the CPUs below the scheduler's when
    that leaves the worker at least one, else they count down from the last, wrapping."""
    if count == 1 or num_cpus < 1:
        return 0
    if num_cpus >= count + 2:
        return 1 + index
    return index % num_cpus


def pin_to_last_cpu(
    log: logging.Logger, tasks: Path = Path("/proc/self/task"), from_last: int = 0
) -> int | None:
    """Move every thread of this process (and so the threads it starts later) onto the last
    CPU of its affinity mask (``from_last`` CPUs below it, wrapping), when the mask has two or
    more; return that CPU, else None (one CPU, or a platform without affinity)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    if len(cpus) < 2:
        return None
    ordered, below = sorted(cpus), from_last % len(cpus)
    last = ordered[-1 - below]
    # sched_setaffinity(0) moves only the calling thread; the threads already started (a
    # tokenizer's pool, ZeroMQ's I/O thread) are moved one by one, by their thread ids.
    threads = [int(task) for task in os.listdir(tasks)] if tasks.is_dir() else [0]
    for thread in threads:
        try:
            os.sched_setaffinity(thread, {last})
        except OSError:  # the thread ended since the listing
            continue
    where = "the last" if below == 0 else f"{below} below the last"
    log.info("on CPU %d (%s of %d this process may use), beside the worker", last, where, len(cpus))
    return last
