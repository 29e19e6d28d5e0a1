"""WorkerSide: the scheduler process's dealings with its one worker.

It owns the worker's socket and what the scheduler knows of the worker: who it is, when it was
last heard, when it was lost. It greets a worker it does not know, fits the process's Engine to
its announcement, sends it steps and applies their results. It knows nothing of frontends:
every handler returns ``WorkerNews``, what the frontends must hear, and the process passes that
on to ``FrontendSide.publish``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from protocol.channel import Channel
from protocol.messages import (
    PROTOCOL_VERSION,
    GrammarCompiled,
    Heartbeat,
    RequestOutput,
    SchedulerHello,
    StepResult,
    WorkerReady,
    WorkerToScheduler,
)
from scheduler.audit_log import AuditLog
from scheduler.engine import Engine
from scheduler.peers import WorkerPeer
from scheduler.restarts import Stalls, rank_mismatch
from scheduler.sizing import geometry
from scheduler.worker_view import WorkerView

log = logging.getLogger("nanoserve.scheduler")


@dataclass(frozen=True)
class WorkerNews:
    """What the frontends must hear after a worker event."""

    outputs: list[RequestOutput] = field(default_factory=list)  # each to its request's owner
    fail_reason: str | None = None  # fail every request, with this reason
    changed: bool = False  # a worker came or went: every frontend gets a new SchedulerInfo


class WorkerSide(WorkerView):
    """The worker's socket and the worker as the scheduler sees it; it steps the engine."""

    def __init__(self, channel: Channel[WorkerToScheduler], engine: Engine) -> None:
        self.channel = channel
        self._engine = engine
        self.worker: WorkerPeer | None = None
        self.lost_since: float | None = None  # monotonic time the last worker was lost
        self.no_worker_reason = "no worker has announced itself yet"
        self.bad_messages = 0
        self.workers_lost = 0
        self.thread_switches = 0  # changes of the worker's thread count seen in its results
        # CPU time of this loop planning steps and applying results (not waiting on the worker,
        # and not time other processes took the core from it)
        self.busy_s = 0.0
        self.audits = AuditLog()
        self._hellos: dict[bytes, float] = {}  # unknown worker peer -> when we last greeted it
        self._nothing_to_plan = False  # the last plan() found nothing: wait for an event
        self.stalls = Stalls()

    # -- messages ------------------------------------------------------------------------------

    def on_message(
        self, peer: bytes, message: WorkerToScheduler, fd: int | None
    ) -> WorkerNews | None:
        """Handle one message from a worker socket."""
        worker = self.worker
        if worker is not None and peer == worker.peer:
            worker.last_seen = time.monotonic()
            worker.fd = fd if fd is not None else worker.fd
        match message:
            case WorkerReady():
                return self._ready(peer, message, fd)
            case StepResult():
                return self._step_done(peer, message)
            case Heartbeat():
                self._heartbeat(message)
            case GrammarCompiled():
                return self._grammar_compiled(message)
        return None

    def bad(self, what: str) -> None:
        """Count and log a message dropped from a worker socket."""
        self.bad_messages += 1
        log.warning("dropped a bad message from %s", what)

    def _heartbeat(self, beat: Heartbeat) -> None:
        # The worker beats from a second socket; ``sender`` names its main one.
        identity = beat.sender.encode()
        if self.worker is not None and identity == self.worker.peer:
            self.worker.last_seen = time.monotonic()
        else:
            self._greet(identity)

    def _grammar_compiled(self, compiled: GrammarCompiled) -> WorkerNews | None:
        """The worker compiled a grammar (from its second socket, like heartbeats): the
        requests held for it are queued."""
        worker = self.worker
        if worker is None or compiled.sender.encode() != worker.peer:
            return None  # a lost worker's: the next one is asked again
        worker.last_seen = time.monotonic()
        if compiled.error:
            log.warning("the worker could not compile grammar %s: %s", compiled.key, compiled.error)
        return WorkerNews(outputs=self._engine.grammar_compiled(compiled.key, compiled.seconds))

    def _greet(self, peer: bytes) -> None:
        """Ask a worker we do not know (we restarted, or it did) to announce itself, once a
        second at most: heartbeats it queued while we were away arrive all at once."""
        now = time.monotonic()
        if now - self._hellos.get(peer, -math.inf) >= 1.0:
            self._hellos[peer] = now
            self.channel.send(SchedulerHello(), peer)

    def _ready(self, peer: bytes, ready: WorkerReady, fd: int | None) -> WorkerNews | None:
        """A worker announced itself: adopt it, with the engine it fits."""
        if ready.protocol_version != PROTOCOL_VERSION:
            self.bad_messages += 1
            log.error(
                "worker %r speaks protocol %d, this scheduler %d: ignored",
                peer,
                ready.protocol_version,
                PROTOCOL_VERSION,
            )
            return None
        if self.worker is not None and peer != self.worker.peer and ready.pool_generation > 1:
            # It took the pool over: the holder granted it only once the last worker was gone,
            # which our socket monitor may not have reported yet (a standby is that quick).
            self.lost("a new worker took its pool over")  # frontends hear with the ready
        engine, before = self._engine, self._engine.ready_info
        restarts = engine.restarts
        reattaches, fallbacks = restarts.reattaches, sum(restarts.fallbacks.values())
        try:
            outputs = engine.fit(ready)
        except ValueError as exc:
            self.bad(f"a worker that does not fit this scheduler: {exc}")
            return None
        if restarts.reattaches > reattaches:
            log.info(
                "the new worker re-attached to pool %s (generation %d): %d running requests "
                "keep their K/V, %d tokens of the lost steps are computed again",
                ready.pool_id,
                ready.pool_generation,
                len(engine.scheduler.running),
                restarts.tokens_recomputed_last,
            )
        elif sum(restarts.fallbacks.values()) > fallbacks:
            kind, which = rank_mismatch(before, ready) if before is not None else ("", "")
            which = which if kind == restarts.last_reason else ""  # which rank, if one was why
            log.warning(
                "the new worker did not re-attach to the lost worker's pool (%s%s): "
                "%d tokens are recomputed",
                restarts.last_reason,
                f": {which}" if which else "",
                restarts.tokens_recomputed_last,
            )
        if before is not None and geometry(before) != geometry(ready):
            log.error(
                "the new worker's cache geometry differs (%s): %d requests end",
                geometry(ready),
                len(outputs),
            )
        elif before is not None and before.num_blocks != ready.num_blocks:
            log.warning(
                "the new worker's pool has %d blocks: %d requests no longer fit",
                ready.num_blocks,
                len(outputs),
            )
        lost_for = time.monotonic() - self.lost_since if self.lost_since is not None else None
        self.worker = WorkerPeer(peer=peer, ready=ready, last_seen=time.monotonic(), fd=fd)
        self.lost_since = None
        self._hellos.clear()
        log.info(
            "worker ready: %s, %d blocks of %d, %d rank%s%s",
            ready.model_id,
            ready.num_blocks,
            ready.block_size,
            ready.tensor_parallel_size,
            "s" if ready.tensor_parallel_size > 1 else "",
            f", {lost_for:.2f} s after the last one was lost" if lost_for is not None else "",
        )
        log.info("worker plan: %s", " ".join(f"{k}={v}" for k, v in ready.plan.items()) or "none")
        return WorkerNews(outputs=outputs, changed=True)

    def _step_done(self, peer: bytes, result: StepResult) -> WorkerNews | None:
        """Apply the oldest step's result (and audit); its outputs go to the frontends."""
        worker, engine = self.worker, self._engine
        if worker is None or peer != worker.peer or not engine.num_in_flight:
            return None
        if result.step_id != engine.in_flight[0].step_id:
            log.warning("stale result for step %d dropped", result.step_id)
            return None
        worker.resident_bytes = result.resident_bytes or worker.resident_bytes
        worker.decode_path = result.decode_path or worker.decode_path
        if result.num_threads and worker.num_threads and result.num_threads != worker.num_threads:
            self.thread_switches += 1
        worker.num_threads = result.num_threads or worker.num_threads
        started = time.thread_time()
        if result.error is not None:
            log.error("worker refused step %d: %s; recomputing", result.step_id, result.error)
            engine.worker_lost()  # the steps in flight too: their results come stale
            return None
        outputs = engine.apply(result)
        if self.stalls.waiting:
            self.stalls.tokens(outputs)
        if engine.config.audit:
            # InvariantViolation ends the process, loudly (the log keeps it for the web page)
            self.audits.run(lambda: engine.audit(result.rows))
        self.busy_s += time.thread_time() - started
        return WorkerNews(outputs=outputs)

    # -- steps ---------------------------------------------------------------------------------

    def can_step(self) -> bool:
        """True if a step could be planned and sent right now."""
        engine = self._engine
        return (
            self.worker is not None
            and engine.can_plan()
            and engine.has_unfinished()
            and not self._nothing_to_plan
        )

    def wake(self) -> None:
        """Something arrived (a request, an abort, a result): the next plan may differ."""
        self._nothing_to_plan = False

    def send_steps(self) -> None:
        """Send steps while fewer than the engine's depth are in flight and there is work."""
        engine, worker = self._engine, self.worker
        if worker is None:
            return
        for ask in engine.grammar_asks():  # compiled beside the steps, in a worker thread
            self.channel.send(ask, worker.peer)
        while self.can_step():
            started = time.thread_time()
            step = engine.plan()
            self.busy_s += time.thread_time() - started
            if step is None:
                self._nothing_to_plan = True
                return
            self.channel.send(step, worker.peer)

    # -- loss ----------------------------------------------------------------------------------

    def lost(self, why: str) -> WorkerNews | None:
        """The worker is gone, its rows with it: running requests wait to be recomputed."""
        if self.worker is None:
            return None
        running = len(self._engine.scheduler.running) if self._engine.fitted else 0
        log.error("worker lost (%s): %d running requests go back to waiting", why, running)
        self.stalls.lost(self._engine.scheduler.running if self._engine.fitted else [])
        self._engine.worker_lost(keep=True)  # its pool may outlive it (a shared one)
        self.worker = None
        self.workers_lost += 1
        self.lost_since = time.monotonic()
        self.no_worker_reason = f"the worker was lost ({why}); waiting for one to come back"
        return WorkerNews(changed=True)

    def give_up(self, reason: str) -> WorkerNews:
        """No worker came back in time: every request fails, and new ones are refused."""
        self.lost_since = None
        self.no_worker_reason = reason
        return WorkerNews(fail_reason=reason, changed=True)
