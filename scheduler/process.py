"""The scheduler process: the Engine's loop, with the worker and the frontends on sockets.

It binds two ROUTER sockets (frontends connect to one, the worker to the other) and never
blocks on the worker: while a step is in flight it keeps taking AddRequest and Abort. An Abort
that lands mid-step is applied to the ledgers at once; the step's sample for that request is
then ignored when the result arrives, so no block leaks and no token reaches a dead request.

Life of one iteration: plan() -> send StepInput -> (adds, aborts, heartbeats) -> StepResult ->
apply() -> audit (with --audit) -> Outputs to each frontend -> plan() again. With overlap (the
default) two steps are in flight: step N+1 is planned and sent as soon as step N is, so the
worker finds its next step queued the moment it finishes one.

Faults: a socket monitor on each ROUTER reports a peer's disconnection at once (the file
descriptor a message arrived on says which peer it was), and silence longer than
``peer_timeout`` is the backstop (an idle worker and every frontend heartbeat twice a second).
A lost worker costs recompute, not requests: every running request goes back to waiting with its
tokens and runs again when a worker announces itself; after ``worker_timeout`` without one, they
fail. A lost frontend's requests are aborted. Garbage is logged, counted and dropped.
"""

from __future__ import annotations

import logging
import math
import signal
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol.addresses import Addresses
from protocol.channel import BadMessage, Channel
from protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineStats,
    FrontendHello,
    FrontendToScheduler,
    Heartbeat,
    Outputs,
    RequestOutput,
    SchedulerHello,
    SchedulerInfo,
    StepResult,
    WorkerReady,
    WorkerToScheduler,
)
from scheduler.peers import (
    Counters,
    Frontends,
    WorkerPeer,
    check_request,
    failed,
    geometry,
)

log = logging.getLogger("nanoserve.scheduler")


class SchedulerProcess:
    """State and message handlers of the scheduler process; ``run`` is its loop."""

    def __init__(
        self,
        *,
        config,
        addresses: Addresses,
        heartbeat_s: float = 0.5,
        peer_timeout: float = 1.5,
        worker_timeout: float = 60.0,
    ) -> None:
        self.config = config
        self.heartbeat_s = heartbeat_s
        self.peer_timeout = peer_timeout
        self.worker_timeout = worker_timeout
        self.context = zmq.Context()
        self.frontends: Channel = Channel(self._bind(addresses.frontend), FrontendToScheduler)
        self.workers: Channel = Channel(self._bind(addresses.worker), WorkerToScheduler)
        closed = zmq.EVENT_DISCONNECTED
        self.monitors = {  # monitor socket -> what to do when one of its connections closes
            self.frontends.socket.get_monitor_socket(closed): self._frontend_fd_closed,
            self.workers.socket.get_monitor_socket(closed): self._worker_fd_closed,
        }
        self.engine = None  # built when the first worker announces its geometry
        self.worker: WorkerPeer | None = None
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self.counters = Counters()
        self.frontends_seen = Frontends()
        self.lost_since: float | None = None  # monotonic time the last worker was lost
        self.no_worker_reason = "no worker has announced itself yet"
        self.stopping = False
        self._hellos: dict[bytes, float] = {}  # unknown worker peer -> when we last greeted it
        self._last_heartbeat = 0.0
        self._nothing_to_plan = False  # the last plan() found nothing: wait for an event

    def _bind(self, address: str) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its identity
        socket.bind(address)
        return socket

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (then return 0)."""
        poller = zmq.Poller()
        poller.register(self.frontends.socket, zmq.POLLIN)
        poller.register(self.workers.socket, zmq.POLLIN)
        for monitor in self.monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self.stopping:
            events = dict(poller.poll(0 if self._can_step() else int(self.heartbeat_s * 1000)))
            if events:
                self._nothing_to_plan = False  # an arrival, abort or result may change the plan
            if self.frontends.socket in events:
                self._drain(self.frontends, self._on_frontend)
            if self.workers.socket in events:
                self._drain(self.workers, self._on_worker)
            for monitor, on_closed in self.monitors.items():
                if monitor in events:
                    self._drain_monitor(monitor, on_closed)
            self._check_liveness()
            self._maybe_step()
            self._maybe_heartbeat()
        log.info("stopped")
        return 0

    def stop(self, *_: object) -> None:
        """Leave the loop after the current iteration (a signal handler)."""
        self.stopping = True

    def close(self) -> None:
        """Close every socket."""
        self.context.destroy(linger=0)

    def _drain(self, channel: Channel, handler) -> None:
        """Handle every message already queued on one socket, without blocking."""
        while channel.socket.poll(0):
            try:
                peer, message, fd = channel.recv_with_fd()
            except BadMessage as exc:
                self._bad(f"peer {exc.peer!r}: {exc}")
                continue
            handler(peer, message, fd)

    def _bad(self, what: str) -> None:
        self.counters.bad_messages += 1
        log.warning("dropped a bad message from %s", what)

    def _drain_monitor(self, monitor: zmq.Socket, on_closed) -> None:
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                on_closed(int(event["value"]))

    def _worker_fd_closed(self, fd: int) -> None:
        if self.worker is not None and self.worker.fd == fd:
            self._worker_lost("its connection closed")

    def _frontend_fd_closed(self, fd: int) -> None:
        for peer in self.frontends_seen.on_fd(fd):
            self._frontend_lost(peer, "its connection closed")

    def _check_liveness(self) -> None:
        """The backstop for a peer that went silent without closing its connection."""
        now = time.monotonic()
        for peer, silent in self.frontends_seen.silent(now, self.peer_timeout):
            self._frontend_lost(peer, f"silent for {silent:.1f} s")
        worker = self.worker
        # Mid-step the beats come from a thread that Python code of the step can delay a little.
        limit = self.peer_timeout * (2 if self._steps_in_flight() else 1)
        if worker is not None and now - worker.last_seen > limit:
            self._worker_lost(f"silent for {now - worker.last_seen:.1f} s")
        lost = self.lost_since
        if self.worker is None and lost is not None and now - lost > self.worker_timeout:
            self.lost_since = None
            self.no_worker_reason = f"no worker came back within {self.worker_timeout:g} s"
            log.error("%s: failing %d requests", self.no_worker_reason, len(self.owner))
            self._fail_all(self.no_worker_reason)
            self._tell_frontends()

    def _steps_in_flight(self) -> int:
        """Steps sent to the current worker whose results have not come back (the engine keeps
        that ledger; a lost worker's steps are forgotten with it)."""
        if self.worker is None or self.engine is None:
            return 0
        return self.engine.num_in_flight

    def _can_step(self) -> bool:
        """True if a step could be planned and sent right now."""
        return (
            self.worker is not None
            and self.engine is not None
            and self.engine.can_plan()
            and self.engine.has_unfinished()
            and not self._nothing_to_plan
        )

    def _maybe_step(self) -> None:
        """Send steps while fewer than the engine's depth are in flight and there is work."""
        while self._can_step():
            started = time.perf_counter()
            step = self.engine.plan()
            self.counters.scheduler_s += time.perf_counter() - started
            if step is None:
                self._nothing_to_plan = True
                return
            self.workers.send(step, self.worker.peer)

    # -- frontends ---------------------------------------------------------------------------

    def _on_frontend(self, peer: bytes, message, fd: int | None) -> None:
        known = self.frontends_seen.heard(peer, time.monotonic(), fd)
        if self._steps_in_flight():
            self.counters.messages_during_step += 1
        match message:
            case AddRequest():
                self._add(peer, message)
            case Abort():
                self._abort(message.request_id)
            case FrontendHello():
                self._hello(peer, message)
            case Heartbeat():
                if not known:  # a frontend from before our restart: tell it who we are
                    self.frontends.send(self._info(), peer)

    def _hello(self, peer: bytes, hello: FrontendHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self.counters.bad_messages += 1
            log.error(
                "frontend %s speaks protocol %d, this scheduler %d: ignored",
                hello.frontend_id,
                hello.protocol_version,
                PROTOCOL_VERSION,
            )
            return
        self.frontends.send(self._info(), peer)

    def _info(self) -> SchedulerInfo:
        ready = self.worker.ready if self.worker else None
        return SchedulerInfo(
            protocol_version=PROTOCOL_VERSION,
            worker_ready=ready is not None,
            model_id=ready.model_id if ready else "",
            max_model_len=ready.max_model_len if ready else 0,
            num_blocks=ready.num_blocks if ready else 0,
            block_size=ready.block_size if ready else 0,
            reason="" if ready else self.no_worker_reason,
        )

    def _tell_frontends(self) -> None:
        info = self._info()
        for frontend in self.frontends_seen:
            self.frontends.send(info, frontend)

    def _frontend_lost(self, peer: bytes, why: str) -> None:
        """Forget a frontend and abort its requests: nobody is left to read their tokens."""
        self.frontends_seen.forget(peer)
        self.counters.frontends_lost += 1
        orphans = [request_id for request_id, owner in self.owner.items() if owner == peer]
        for request_id in orphans:
            self._abort(request_id)
        log.warning("frontend %r lost (%s): aborted its %d requests", peer, why, len(orphans))

    def _add(self, peer: bytes, add: AddRequest) -> None:
        if self.engine is None or (self.worker is None and self.lost_since is None):
            self._reply(peer, [failed(add.request_id, self.no_worker_reason)])
            return
        if add.request_id in self.owner:
            self._bad(f"peer {peer!r}: request id {add.request_id!r} is already in use")
            return
        try:
            # The frontend validates; this is the last line of defence for a raw peer, so that
            # a poisonous request can never crash the worker over and over.
            check_request(add, self.engine.ready_info.vocab_size)
            self.engine.add_request(add.request_id, list(add.prompt_token_ids), add.params)
        except ValueError as exc:
            self._reply(peer, [failed(add.request_id, str(exc))])
            return
        self.owner[add.request_id] = peer

    def _fail_all(self, reason: str) -> None:
        """Fail every request: each owner gets finish_reason "error" with ``reason``."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for request_id, peer in self.owner.items():
            if self.engine is not None:
                self.engine.abort(request_id)
            by_peer.setdefault(peer, []).append(failed(request_id, reason))
        self.owner.clear()
        for peer, batch in by_peer.items():
            self._reply(peer, batch)

    def _abort(self, request_id: str) -> None:
        if self.engine is not None and request_id in self.owner:
            self.engine.abort(request_id)
        self.owner.pop(request_id, None)

    def _reply(self, peer: bytes, outputs: list[RequestOutput]) -> None:
        self.frontends.send(Outputs(outputs=outputs, stats=self._stats()), peer)

    # -- worker ------------------------------------------------------------------------------

    def _on_worker(self, peer: bytes, message, fd: int | None) -> None:
        if self.worker is not None and peer == self.worker.peer:
            self.worker.last_seen = time.monotonic()
            self.worker.fd = fd if fd is not None else self.worker.fd
        match message:
            case WorkerReady():
                self._worker_ready(peer, message, fd)
            case StepResult():
                self._step_done(peer, message)
            case Heartbeat():
                # The worker beats from a second socket; ``sender`` names its main one.
                identity = message.sender.encode()
                if self.worker is not None and identity == self.worker.peer:
                    self.worker.last_seen = time.monotonic()
                else:
                    self._greet(identity)

    def _greet(self, peer: bytes) -> None:
        """Ask a worker we do not know (we restarted, or it did) to announce itself, once a
        second at most: heartbeats it queued while we were away arrive all at once."""
        now = time.monotonic()
        if now - self._hellos.get(peer, -math.inf) >= 1.0:
            self._hellos[peer] = now
            self.workers.send(SchedulerHello(), peer)

    def _worker_ready(self, peer: bytes, ready: WorkerReady, fd: int | None) -> None:
        if ready.protocol_version != PROTOCOL_VERSION:
            self._bad(
                f"a worker speaking protocol {ready.protocol_version}, not {PROTOCOL_VERSION}"
            )
            return
        from scheduler.engine import Engine

        if self.engine is not None and geometry(self.engine.ready_info) != geometry(ready):
            log.error("the new worker's cache geometry differs: %s", geometry(ready))
            self._fail_all("the worker was replaced by one with a different model or cache")
            self.engine = None
        if self.engine is None:
            try:
                self.engine = Engine(ready, self.config)
            except ValueError as exc:
                self._bad(f"a worker that does not fit this scheduler: {exc}")
                return
        else:
            self.engine.worker_lost()  # running requests go back to waiting with their tokens
        lost_for = time.monotonic() - self.lost_since if self.lost_since is not None else None
        self.worker = WorkerPeer(peer=peer, ready=ready, last_seen=time.monotonic(), fd=fd)
        self.lost_since = None
        self._hellos.clear()
        log.info(
            "worker ready: %s, %d blocks of %d%s",
            ready.model_id,
            ready.num_blocks,
            ready.block_size,
            f", {lost_for:.2f} s after the last one was lost" if lost_for is not None else "",
        )
        self._tell_frontends()

    def _worker_lost(self, why: str) -> None:
        """The worker is gone: its rows with it. Running requests wait to be recomputed."""
        if self.worker is None:
            return
        running = self.engine.stats().num_running if self.engine is not None else 0
        log.error("worker lost (%s): %d running requests go back to waiting", why, running)
        if self.engine is not None:
            self.engine.worker_lost()
        self.worker = None
        self.counters.workers_lost += 1
        self.lost_since = time.monotonic()
        self.no_worker_reason = f"the worker was lost ({why}); waiting for one to come back"
        self._tell_frontends()

    def _step_done(self, peer: bytes, result: StepResult) -> None:
        worker = self.worker
        if worker is None or peer != worker.peer or not self._steps_in_flight():
            return
        if result.step_id != self.engine.in_flight[0].step_id:
            log.warning("stale result for step %d dropped", result.step_id)
            return
        worker.busy_s += result.forward_s
        worker.resident_bytes = result.resident_bytes or worker.resident_bytes
        self.counters.steps += 1
        started = time.perf_counter()
        if result.error is not None:
            log.error("worker refused step %d: %s; recomputing", result.step_id, result.error)
            self.engine.worker_lost()  # the steps in flight too: their results come stale
            return
        outputs = self.engine.apply(result)
        if self.config.audit:
            self.engine.audit(result.rows)  # InvariantViolation ends the process, loudly
        self.counters.scheduler_s += time.perf_counter() - started
        self._route(outputs)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Send each frontend the outputs of its own requests, finished ones forgotten."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for output in outputs:
            peer = self.owner.get(output.request_id)
            if peer is None:
                continue  # aborted while its step was in flight
            by_peer.setdefault(peer, []).append(output)
            if output.finish_reason is not None:
                del self.owner[output.request_id]
        for peer, batch in by_peer.items():
            self._reply(peer, batch)

    # -- liveness ------------------------------------------------------------------------------

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat < self.heartbeat_s:
            return
        self._last_heartbeat = now
        beat = Heartbeat(sender="scheduler", time=time.time())
        for frontend in self.frontends_seen:
            self.frontends.send(Outputs(outputs=[], stats=self._stats()), frontend)
            self.frontends.send(beat, frontend)

    def _stats(self) -> EngineStats:
        base = self.engine.stats() if self.engine is not None else EngineStats()
        return EngineStats(
            num_running=base.num_running,
            num_waiting=base.num_waiting,
            kv_blocks_used=base.kv_blocks_used,
            kv_blocks_total=base.kv_blocks_total,
            num_preemptions_total=base.num_preemptions_total,
            num_steps_total=self.counters.steps,
            worker_ready=self.worker is not None,
            worker_busy_s_total=self.worker.busy_s if self.worker else 0.0,
            steps_in_flight=self._steps_in_flight(),
            worker_resident_bytes=self.worker.resident_bytes if self.worker else 0,
            messages_during_step_total=self.counters.messages_during_step,
            scheduler_busy_s_total=self.counters.scheduler_s,
            bad_messages_total=self.counters.bad_messages,
            workers_lost_total=self.counters.workers_lost,
            frontends_lost_total=self.counters.frontends_lost,
        )


def run_scheduler(
    *,
    config,
    addresses: Addresses,
    heartbeat_s: float = 0.5,
    worker_timeout: float = 60.0,
) -> int:
    """Entry function of the scheduler process. ``config`` is a scheduler.config.SchedulerConfig.

    Requests wait up to ``worker_timeout`` seconds for a lost worker to come back.
    """
    process = SchedulerProcess(
        config=config, addresses=addresses, heartbeat_s=heartbeat_s, worker_timeout=worker_timeout
    )
    signal.signal(signal.SIGTERM, process.stop)
    signal.signal(signal.SIGINT, process.stop)
    try:
        return process.run()
    finally:
        process.close()
