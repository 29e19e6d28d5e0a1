"""The worker process: load the model, allocate the cache, announce the geometry, run steps.

The worker connects a DEALER socket to the scheduler's worker endpoint and then only answers:
each StepInput gets exactly one StepResult. While idle it sends a Heartbeat every
``heartbeat_s`` so the scheduler can tell a dead worker from a quiet one. A SchedulerHello means
"announce yourself": a new scheduler knows nothing of our rows, so they are all dropped first.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from protocol.addresses import Addresses
from protocol.channel import BadMessage, Channel
from protocol.messages import (
    Heartbeat,
    SchedulerHello,
    SchedulerToWorker,
    Shutdown,
    StepInput,
    StepResult,
)

log = logging.getLogger("nanoserve.worker")


def run_worker(
    *, config, addresses: Addresses, heartbeat_s: float = 0.5, step_delay_s: float = 0.0
) -> int:
    """Serve steps until Shutdown or a signal. ``config`` is a worker.config.WorkerConfig.

    ``step_delay_s`` slows every step down on purpose, for tests that show the scheduler keeps
    taking requests while the worker computes.
    """
    from worker.worker import Worker  # torch loads here, not at import time of this module

    worker = Worker(config)
    ready = worker.ready()
    log.info(
        "model %s ready on %s/%s: %d blocks of %d, %d slots, max_model_len %d",
        ready.model_id,
        ready.device,
        ready.dtype,
        ready.num_blocks,
        ready.block_size,
        ready.num_slots,
        ready.max_model_len,
    )
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(addresses.worker)
    channel: Channel = Channel(socket, SchedulerToWorker)
    channel.send(ready)
    sender = f"worker-{os.getpid()}"
    last_sent = time.monotonic()
    try:
        while True:
            if socket.poll(int(heartbeat_s * 1000)):
                try:
                    _, message = channel.recv()
                except BadMessage as exc:
                    log.warning("dropped a bad message from the scheduler: %s", exc)
                    continue
                match message:
                    case StepInput():
                        if step_delay_s:
                            time.sleep(step_delay_s)
                        channel.send(_execute(worker, message))
                    case SchedulerHello():
                        worker.reset()
                        channel.send(worker.ready())
                    case Shutdown():
                        log.info("shutdown: %s", message.reason or "asked by the scheduler")
                        return 0
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= heartbeat_s:
                channel.send(Heartbeat(sender=sender, time=time.time()))
                last_sent = time.monotonic()
    finally:
        socket.close(0)
        context.term()


def _execute(worker, step: StepInput) -> StepResult:
    """Run one step. A step the worker refuses (a protocol violation) is logged and answered
    with an error, so the scheduler recovers instead of waiting forever."""
    started = time.perf_counter()
    try:
        result = worker.execute(step)
    except ValueError as exc:
        log.error("step %d refused: %s", step.step_id, exc)
        worker.reset()  # the rows may be half-updated: drop them all, the scheduler recomputes
        return StepResult(step_id=step.step_id, samples=[], error=str(exc))
    elapsed = time.perf_counter() - started
    return StepResult(
        step_id=result.step_id, samples=result.samples, rows=result.rows, forward_s=elapsed
    )
