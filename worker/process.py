"""The worker process: load the model, allocate the cache, announce the geometry, run steps.

The worker connects a DEALER socket to the scheduler's worker endpoint and then only answers:
each StepInput gets exactly one StepResult, in order, with up to two steps in flight
(``worker.step.loop``). A second thread sends a Heartbeat every
``heartbeat_s`` on a socket of its own, busy or idle, so the scheduler can tell a dead (or hung)
worker from a busy one; the beat names the main socket's identity. The same thread sends each
GrammarCompiled as soon as a CompileGrammar's compile (in a compile thread) ends. A
SchedulerHello means "announce yourself": a new scheduler knows nothing of our rows, so they
are all dropped first.
SIGTERM or SIGINT ends it cleanly (exit 0) between steps.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid

import zmq

from protocol.addresses import Addresses
from protocol.channel import BadMessage, Channel
from protocol.messages import (
    PROTOCOL_VERSION,
    CompileGrammar,
    GrammarCompiled,
    Heartbeat,
    SchedulerHello,
    SchedulerToWorker,
    Shutdown,
    StepInput,
    WorkerReady,
)

log = logging.getLogger("nanoserve.worker")


def run_worker(
    *,
    config,
    addresses: Addresses,
    heartbeat_s: float = 0.5,
    step_delay_s: float = 0.0,
    group=None,
) -> int:
    """Serve steps until Shutdown or a signal. ``config`` is a worker.config.WorkerConfig.

    ``step_delay_s`` slows every step down on purpose, for tests that show the scheduler keeps
    taking requests while the worker computes. ``group``: rank 0's ``worker.parallel.group.Group``
    when the worker is several ranks (``worker.parallel.ranks``); the others follow what this one
    does.
    """
    from worker.faults import arm_from_environment
    from worker.parallel.group import SOLO
    from worker.worker import Worker  # torch loads here, not at import time of this module

    worker = Worker(config, group=group or SOLO, background_compile=True, holder=addresses.holder)
    arm_from_environment(worker)  # a test's fault injector (worker.faults); unset: nothing
    ready = worker.ready()
    _log_ready(worker, ready)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    # A known identity, so heartbeats from the second socket can say whose liveness they carry.
    identity = f"worker-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    socket.setsockopt(zmq.ROUTING_ID, identity.encode())
    socket.connect(addresses.worker)
    channel: Channel = Channel(socket, SchedulerToWorker)
    channel.send(ready)
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stopping.append(number))
    beats = threading.Event()
    news: queue.SimpleQueue[GrammarCompiled] = queue.SimpleQueue()  # for the heartbeat thread
    heart = threading.Thread(
        target=_heartbeats,
        args=(context, addresses.worker, identity, heartbeat_s, beats, news),
        name="heartbeats",
        daemon=True,
    )
    heart.start()
    try:
        compiled = _grammar_news(identity, news)
        code = _serve(channel, worker, stopping, heartbeat_s, step_delay_s, compiled)
        log.info("stopped (%s)", f"signal {stopping[0]}" if stopping else "shutdown")
        worker.close()  # the other ranks too (a failed collective raises past this instead)
        return code
    finally:
        beats.set()
        heart.join(5.0)
        socket.close(0)
        context.term()


def _log_ready(worker, ready: WorkerReady) -> None:
    """What the worker loaded and how it will run its steps."""
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
    if ready.tensor_parallel_size > 1:
        log.info(
            "tensor parallel: %d ranks, each with its share of heads", ready.tensor_parallel_size
        )
    # The plan, one line: how every step runs (worker.plan), what /metrics and the page show.
    log.info("plan: %s", " ".join(f"{key}={value}" for key, value in ready.plan.items()))
    if worker.q4_linears:
        log.info("%d linears run on the model file's 4-bit matrices", worker.q4_linears)
    job = worker.compile_job
    if job is not None:
        log.info(
            "serving eagerly while compiled decode steps are %s in the background",
            "compiled (minutes, at the lowest CPU priority)"
            if job.cold
            else "loaded from the cache",
        )


def _grammar_news(identity: str, news: queue.SimpleQueue):
    """The callback of one CompileGrammar: its GrammarCompiled, queued for the heartbeat
    thread."""

    def compiled(key: str):
        def done(error: str, seconds: float) -> None:
            news.put(GrammarCompiled(sender=identity, key=key, error=error, seconds=seconds))

        return done

    return compiled


def _serve(
    channel: Channel,
    worker,
    stopping: list[int],
    poll_s: float,
    delay_s: float,
    compiled=None,
) -> int:
    """Answer the scheduler until Shutdown (or a signal lands in ``stopping``), two steps in
    flight at most (``worker.step.loop``). ``compiled(key)``: the callback that reports the
    compile of CompileGrammar ``key``."""
    from worker.compiled.background import step_first  # loaded with the worker (torch) by now
    from worker.step.loop import StepLoop

    loop = StepLoop(
        worker,
        channel,
        step_first=lambda: step_first(worker.compile_job),
        extra=lambda: {"resident_bytes": resident_bytes()},
    )
    bad = 0
    try:
        while not stopping:
            loop.answer_ready()
            if loop.full:
                loop.answer_oldest()
                continue
            if not loop.wait(poll_s):
                if not loop.pending:
                    worker.idle()
                continue
            try:
                _, message = channel.recv()
            except BadMessage as exc:
                bad += 1
                log.warning("dropped bad message #%d from the scheduler: %s", bad, exc)
                continue
            match message:
                case StepInput():
                    if delay_s:
                        time.sleep(delay_s)
                    loop.launch(message)
                case SchedulerHello() if message.protocol_version != PROTOCOL_VERSION:
                    bad += 1
                    log.error(
                        "a scheduler speaking protocol %d, not %d: ignored",
                        message.protocol_version,
                        PROTOCOL_VERSION,
                    )
                case CompileGrammar() if compiled is not None:
                    worker.grammar.compile(message.grammar, compiled(message.key))
                case SchedulerHello():
                    loop.answer_all()  # the steps sent before it are answered first
                    worker.reset()
                    channel.send(worker.ready())
                case Shutdown():
                    loop.answer_all()
                    log.info("shutdown: %s", message.reason or "asked by the scheduler")
                    return 0
        loop.answer_all()
        return 0
    finally:
        loop.close()


def _heartbeats(
    context: zmq.Context,
    address: str,
    identity: str,
    period: float,
    stop: threading.Event,
    news: queue.SimpleQueue | None = None,
) -> None:
    """Beat every ``period`` from a socket of this thread's own, so that a long step (the main
    thread busy in the forward, which releases the GIL) still shows the worker alive, and a
    hung or stopped one goes quiet. Beats are dropped, never queued up, while no one listens.
    Each message in ``news`` (a GrammarCompiled) is sent as it arrives, between beats: the main
    socket only answers steps, and may be busy in one."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 64)
    socket.connect(address)
    channel: Channel[SchedulerToWorker] = Channel(socket, SchedulerToWorker)  # it only sends
    news = news or queue.SimpleQueue()
    due = time.monotonic() + period
    try:
        while not stop.is_set():
            try:
                channel.try_send(news.get(timeout=max(0.0, due - time.monotonic())))
                continue
            except queue.Empty:
                pass
            channel.try_send(Heartbeat(sender=identity, time=time.time()))
            due = time.monotonic() + period
    finally:
        socket.close(0)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere): a few microseconds."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0
