"""ThreadGovernor: the worker's intra-op thread count, chosen between steps from what the CPUs
really give it.

A step is hundreds of OpenMP parallel regions, each ending at a barrier. On a machine of two
cores, a CPU-bound process from another session (another autogroup, so ``nice`` does not help)
takes half of one core: the worker thread on that core runs only between the neighbour's
timeslices, and every barrier waits for it. The step does not slow by half; it collapses
(docs/performance.md: 8 ms steps took seconds). One thread has no barrier to wait at, and
keeps the core the neighbour leaves free.

The signal is the time this process's threads spend runnable but not running (the second
field of ``/proc/self/task/*/schedstat``), per second of stepping, read every ``window_s`` of
stepping (idle time between steps would only dilute it). Our own frontend and scheduler wake
in short bursts and cost little of it; a neighbour that holds a core costs a whole thread's
worth. Above ``threshold`` the governor
drops to one thread. One thread cannot see whether the neighbour left (it has its own core),
so after ``backoff_s`` it probes: the full count for one window, kept if the wait stays under
the threshold, else one thread again and a doubled backoff (at most ``max_backoff_s``), so a
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


def runnable_wait_s(task_dir: Path = Path("/proc/self/task")) -> float | None:
    """Seconds this process's threads, together, have spent waiting for a CPU while runnable;
    None where the kernel does not say (no schedstat: not Linux, or a kernel built without it)."""
    total = 0
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
        total += int(fields[1])
    return total / 1e9


class ThreadGovernor:
    """Sets torch's thread count between steps: ``full`` while the CPUs are ours, 1 while a
    neighbour holds one. Call ``after_step`` in the thread that runs the steps (OpenMP keeps the
    count per thread)."""

    def __init__(
        self,
        full: int,
        *,
        threshold: float = 0.25,
        window_s: float = 0.25,
        backoff_s: float = 2.0,
        max_backoff_s: float = 60.0,
        read_wait: Callable[[], float | None] = runnable_wait_s,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.full = full
        self.threshold = threshold
        self.window_s = window_s
        self.min_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.backoff_s = backoff_s
        self.threads = full
        self.switches = 0  # how many times the count changed
        self.last_wait = 0.0  # the last window's wait: thread-seconds per second of stepping
        self._read_wait, self._clock, self._set_threads = read_wait, clock, set_threads
        self._probing = False
        self._probe_at = 0.0
        self.enabled = full > 1 and read_wait() is not None
        self._begin()

    def after_step(self, step_s: float) -> None:
        """Count a step that took ``step_s``; once the window holds ``window_s`` of steps,
        change the count if its wait says so."""
        if not self.enabled:
            return
        if self.threads == 1 and not self._probing:
            if self._clock() >= self._probe_at:
                self._probing = True
                self._switch(self.full, "")
                self._begin()
            return
        self._busy += step_s
        if self._busy < self.window_s:
            return
        wait = self._read_wait() or 0.0
        self.last_wait = (wait - self._waited) / self._busy
        self._begin(wait)
        if self.last_wait > self.threshold:
            if self._probing:
                self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
            self._probing = False
            self._probe_at = self._clock() + self.backoff_s
            self._switch(1, f"its threads waited {self.last_wait:.2f} s per second of stepping")
        elif self._probing:
            self._probing = False
            self.backoff_s = self.min_backoff_s
            log.info("the cores are free again: %d threads (%.2f)", self.full, self.last_wait)

    def _begin(self, wait: float | None = None) -> None:
        """Start a window: no stepping counted yet, the wait as it stands."""
        self._busy = 0.0
        self._waited = (self._read_wait() or 0.0) if wait is None else wait

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
