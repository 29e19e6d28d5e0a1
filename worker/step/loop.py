"""``StepLoop``: the worker process's steps, two in flight, each answered once, in order.

The scheduler sends step N+1 while the worker computes step N (``scheduler.engine``'s overlap).
The loop launches each step as it arrives (``Worker.launch``: queued on the device, nothing
waited for), up to ``DEPTH`` of them, and answers the oldest as soon as its sampled ids are back
(``Worker.finish``). So on a GPU the host prepares and queues step N+1 while the device runs
step N. On the CPU a step's work is done when its launch returns, so the oldest is answered at
once, before the next is even read: the same order as running steps one by one.

Readiness does not come by polling: a waiter thread waits on each launched step's fence and
then writes a byte to a pipe that the loop polls together with the scheduler's socket. Every
StepInput gets exactly one StepResult, in the order the steps came; a refused one is answered
with an error in its turn.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from protocol.channel import Channel
from protocol.messages import StepInput, StepResult

log = logging.getLogger("nanoserve.worker")

DEPTH = 2  # steps launched and not answered, at most (the scheduler sends no more)


class StepLoop:
    """Launches a worker's steps and sends their results on ``channel``. ``step_first`` gives
    the context every launch and finish runs in; ``extra`` the process's facts each result
    carries (``StepResult`` fields)."""

    def __init__(
        self,
        worker,
        channel: Channel,
        *,
        step_first: Callable[[], Any] = contextlib.nullcontext,
        extra: Callable[[], dict] = dict,
        depth: int = DEPTH,
    ) -> None:
        self.worker, self.channel, self.depth = worker, channel, depth
        self.step_first, self.extra = step_first, extra
        self._pending: deque = deque()  # Launched, or a refused step's StepResult, oldest first
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fences")
        self._poller = zmq.Poller()
        self._poller.register(channel.socket, zmq.POLLIN)
        self._poller.register(self._read_fd, zmq.POLLIN)

    @property
    def pending(self) -> int:
        """Steps received and not answered."""
        return len(self._pending)

    @property
    def full(self) -> bool:
        """Whether the loop must answer a step before it reads another."""
        return len(self._pending) >= self.depth

    def wait(self, timeout_s: float) -> bool:
        """Wait until a message can be read (True), or a launched step is done or the timeout
        passes (False: answer what is ready first)."""
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._read_fd in events:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read_fd, 4096):
                    pass
            return False
        return self.channel.socket in events

    def launch(self, step: StepInput) -> None:
        """Launch ``step`` behind the pending ones. A step the worker refuses (a protocol
        violation) is logged and answered with an error in its turn, so the scheduler recovers
        instead of waiting forever."""
        try:
            with self.step_first():
                launched = self.worker.launch(step)
        except ValueError as exc:
            log.error("step %d refused: %s", step.step_id, exc)
            self.worker.reset()  # the rows may be half-updated: drop them all, it recomputes
            self._pending.append(StepResult(step_id=step.step_id, samples=[], error=str(exc)))
            return
        self._pending.append(launched)
        self._waiter.submit(self._wake_after, launched)

    def answer_ready(self) -> None:
        """Send the result of every pending step whose sampled ids are back, oldest first."""
        while self._pending and _ready(self._pending[0]):
            self.answer_oldest()

    def answer_all(self) -> None:
        """Wait for and send every pending result (before a Hello or a Shutdown is handled, and
        before the process stops)."""
        while self._pending:
            self.answer_oldest()

    def answer_oldest(self) -> None:
        """Wait for the oldest pending step and send its result."""
        oldest = self._pending.popleft()
        if isinstance(oldest, StepResult):
            self.channel.send(oldest)
            return
        with self.step_first():
            result = self.worker.finish(oldest)
        self.channel.send(msgspec.structs.replace(result, **self.extra()))

    def _wake_after(self, launched) -> None:
        """In the waiter thread: once the step's sampled ids are back, wake the loop."""
        launched.fence.wait()
        os.write(self._write_fd, b"x")

    def close(self) -> None:
        """Stop the waiter thread and close the pipe."""
        self._waiter.shutdown(wait=True)
        os.close(self._read_fd)
        os.close(self._write_fd)


def _ready(entry) -> bool:
    return isinstance(entry, StepResult) or entry.done()
