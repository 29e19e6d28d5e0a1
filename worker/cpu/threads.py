"""ThreadGovernor: the worker's intra-op thread count, chosen between steps from what the CPUs
really give it.

A step is hundreds of OpenMP parallel regions, each ending at a barrier. On a machine of two
cores, a CPU-bound process from another session (another autogroup, so ``nice`` does not help)
takes half of one core: the worker thread on that core runs only between the neighbour's
timeslices, and every barrier waits for it. The step does not slow by half; it collapses
(docs/performance.md: 8 ms steps took seconds). One thread has no barrier to wait at, and
keeps the core the neighbour leaves free.

The signal is how long this process's busy threads spend runnable but not running, as a share
of the time they are runnable (the first two fields of ``/proc/self/task/*/schedstat``: time on
a CPU, time waiting for one), over every ``window_s`` of stepping; a window that was mostly
idle decides nothing. A neighbour that holds a core makes the threads beside it wait about half
of the time (measured: 0.47 of every second each, both taking turns); our own frontend and
scheduler wake in short bursts and cost a few percent. Threads that barely ran in the window
(ZeroMQ's, the heartbeat) are left out: they wait on every wake-up, whatever the load. The KV
pool's populating thread runs only while no step does (``worker.kv.host_pool``). Above
``threshold`` the governor drops to one thread. One thread cannot see whether the neighbour
left (it has a core of its own), so after ``backoff_s`` it probes: the full count for one
window or ``probe_steps`` steps, whichever is shorter, kept if the share stays under
``free_below``, else one thread again and a doubled backoff (at most ``max_backoff_s``), so a
neighbour that stays costs a probe a minute at most.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("nanoserve.worker")


Times = dict[str, tuple[float, float]]  # thread id -> (seconds on a CPU, seconds waiting)


def thread_times(task_dir: Path = Path("/proc/self/task")) -> Times | None:
    """Each thread's seconds on a CPU and seconds runnable but waiting for one; None where the
    kernel does not say (not Linux, or a kernel built without schedstats)."""
    times: Times = {}
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task_dir / task / "schedstat").read_text().split()
        except OSError:  # the thread ended between the listing and the read
            continue
        if len(fields) < 2:
            return None
        times[task] = (int(fields[0]) / 1e9, int(fields[1]) / 1e9)
    return times


def waiting_share(before: Times, after: Times, wall_s: float, busy: float = 0.1) -> float:
    """The share of their runnable time that the threads busy over ``wall_s`` (on a CPU or
    waiting for one at least ``busy`` of it) spent waiting; 0.0 when none was busy."""
    ran = waited = 0.0
    for task, (run, wait) in after.items():
        run0, wait0 = before.get(task, (0.0, 0.0))  # a thread born in the window: all of it
        if (run - run0) + (wait - wait0) >= busy * wall_s:
            ran += run - run0
            waited += wait - wait0
    return waited / (ran + waited) if ran + waited > 0 else 0.0


class ThreadGovernor:
    """Sets torch's thread count between steps: ``full`` while the CPUs are ours, 1 while a
    neighbour holds one. Call ``after_step`` in the thread that runs the steps (OpenMP keeps the
    count per thread)."""

    def __init__(
        self,
        full: int,
        *,
        threshold: float = 0.35,
        free_below: float = 0.2,
        window_s: float = 0.25,
        probe_steps: int = 3,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
        read_times: Callable[[], Times | None] = thread_times,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.full = full
        self.threshold = threshold
        self.free_below = free_below
        self.window_s = window_s
        self.probe_steps = probe_steps
        self.min_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.backoff_s = backoff_s
        self.threads = full
        self.switches = 0  # how many times the count changed
        self.last_share = 0.0  # the last window's share of runnable time spent waiting
        self._read_times, self._clock, self._set_threads = read_times, clock, set_threads
        self._probing = False
        self._probe_at = 0.0
        self.enabled = full > 1 and read_times() is not None
        self._begin()

    def after_step(self, step_s: float) -> None:
        """Count a step that took ``step_s``; once the window holds ``window_s`` of steps,
        change the count if its waiting share says so."""
        if not self.enabled:
            return
        if self.threads == 1 and not self._probing:
            if self._clock() >= self._probe_at:
                self._probing = True
                self._switch(self.full, "")
                self._begin()
            return
        self._busy += step_s
        self._steps += 1
        # A probe decides after a few steps: beside a neighbour each may take a second.
        if self._busy < self.window_s and not (self._probing and self._steps >= self.probe_steps):
            return
        now, times = self._clock(), self._read_times() or {}
        wall = now - self._began
        if self._busy < wall / 2:  # mostly idle: its wake-ups would blur the share
            self._begin(now, times)
            return
        self.last_share = waiting_share(self._times, times, wall)
        self._begin(now, times)
        # Hysteresis: a probe is kept only well under the threshold (beside a neighbour, short
        # probes read 25-33% now and then, and flapped back two seconds later).
        if self.last_share > (self.free_below if self._probing else self.threshold):
            if self._probing:
                self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
            self._probing = False
            self._probe_at = now + self.backoff_s
            self._switch(1, f"its threads waited {self.last_share:.0%} of their runnable time")
        elif self._probing:
            self._probing = False
            self.backoff_s = self.min_backoff_s
            log.info(
                "the cores are free again: %d threads (%.0f%%)", self.full, self.last_share * 100
            )

    def _begin(self, now: float | None = None, times: Times | None = None) -> None:
        """Start a window: no stepping counted yet, the threads' times as they stand."""
        self._busy, self._steps = 0.0, 0
        self._began = self._clock() if now is None else now
        self._times = (self._read_times() or {}) if times is None else times

    def _switch(self, threads: int, why: str) -> None:
        self._set_threads(threads)
        self.threads = threads
        self.switches += 1
        if threads == 1:
            log.info(
                "another process holds a core (%s): 1 thread, probing again in %.0f s",
                why,
                self.backoff_s,
            )
