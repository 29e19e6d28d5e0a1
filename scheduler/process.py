"""The scheduler process: the Engine's loop, with the worker and the frontends on sockets.

It binds two ROUTER sockets (frontends connect to one, the worker to the other) and never
blocks on the worker: while a step is in flight it keeps taking AddRequest and Abort. An Abort
that lands mid-step is applied to the ledgers at once; the step's sample for that request is
then ignored when the result arrives, so no block leaks and no token reaches a dead request.

Life of one iteration: plan() -> send StepInput -> (adds, aborts, heartbeats) -> StepResult ->
apply() -> audit (with --audit) -> Outputs to each frontend -> plan() again. With overlap (the
default) two steps are in flight: step N+1 is planned and sent as soon as step N is, so the
worker finds its next step queued the moment it finishes one.

The loop and the ``Engine`` are here, the engine handed to each peer's side: ``WorkerSide`` (the
worker's announcement, which fits the engine, steps and their results), ``FrontendSide``
(hellos, adds and aborts on the engine, routing outputs) and ``Liveness`` (monitors, silence,
heartbeats). Garbage is logged, counted and dropped by the side whose socket it arrived on.
``Monitor`` publishes snapshots for the web page while a frontend subscribes, and
``KvPublisher`` the prefix cache's KV events once an iteration, when configured.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

import zmq

from protocol.addresses import Addresses
from protocol.channel import BadMessage, Channel
from protocol.messages import FrontendToScheduler, WorkerToScheduler
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.errors import InvariantViolation
from scheduler.frontend_side import FrontendSide
from scheduler.kv_publisher import KvPublisher
from scheduler.liveness import Liveness
from scheduler.monitor import Monitor
from scheduler.worker_side import WorkerSide

log = logging.getLogger("nanoserve.scheduler")


class SchedulerProcess:
    """The scheduler process's sockets and sides; ``run`` is its loop."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        addresses: Addresses,
        heartbeat_s: float = 0.5,
        peer_timeout: float = 1.5,
        worker_timeout: float = 60.0,
    ) -> None:
        self.heartbeat_s = heartbeat_s
        self.context = zmq.Context()
        worker_channel = Channel(self._bind(addresses.worker), WorkerToScheduler)
        frontend_channel = Channel(self._bind(addresses.frontend), FrontendToScheduler)
        # sized when the first worker announces itself; constrained requests wait for their
        # grammar's compile outside the queues (scheduler.grammar_gate)
        self.engine = Engine(None, config, gate_grammars=True)
        self.workers = WorkerSide(worker_channel, self.engine)
        self.frontends = FrontendSide(frontend_channel, self.engine, self.workers)
        self.liveness = Liveness(
            self.frontends,
            self.workers,
            heartbeat_s=heartbeat_s,
            peer_timeout=peer_timeout,
            worker_timeout=worker_timeout,
        )
        self.monitor = Monitor(self._feed(addresses.monitor), self.frontends, self.workers)
        self.kv_events: KvPublisher | None = None  # vLLM's KV events, when configured
        if config.kv_events_endpoint:
            self.kv_events = KvPublisher(
                self.context,
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                config.kv_events_topic,
                config.kv_events_format,
            )
        self.stopping = False

    def _feed(self, address: str | None) -> zmq.Socket | None:
        """The web page's feed: an XPUB that drops what a slow subscriber cannot take."""
        if address is None:
            return None
        socket = self.context.socket(zmq.XPUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 8)
        socket.bind(address)
        return socket

    def _bind(self, address: str) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its identity
        socket.bind(address)
        return socket

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (then return 0)."""
        poller = self.poller()
        try:
            while not self.stopping:
                self.turn(poller)
        except InvariantViolation:
            self.monitor.publish()  # the page shows the failed audit before we go
            raise
        log.info("stopped")
        return 0

    def poller(self) -> zmq.Poller:
        """A poller over every socket the loop reads."""
        poller = zmq.Poller()
        for socket in (self.frontends.channel.socket, self.workers.channel.socket):
            poller.register(socket, zmq.POLLIN)
        self.liveness.register(poller)
        if self.monitor.socket is not None:
            poller.register(self.monitor.socket, zmq.POLLIN)
        if self.kv_events is not None and self.kv_events.replay is not None:
            poller.register(self.kv_events.replay, zmq.POLLIN)
        return poller

    def turn(self, poller: zmq.Poller) -> None:
        """One iteration of the loop: wait for events (not at all while a step could be sent),
        handle them, then send steps, beat and publish as due."""
        frontends, workers = self.frontends.channel, self.workers.channel
        wait_ms = 0 if self.workers.can_step() else int(self.heartbeat_s * 1000)
        events = dict(poller.poll(wait_ms))
        if events:
            self.workers.wake()  # an arrival, abort or result may change the plan
        if frontends.socket in events:
            _drain(frontends, self.frontends.on_message, self.frontends.bad)
        if workers.socket in events:
            _drain(workers, self._on_worker, self.workers.bad)
        self.liveness.on_events(events)
        self.monitor.on_events(events)
        self.liveness.check()
        self.workers.send_steps()
        self.liveness.maybe_heartbeat()
        self.monitor.maybe_publish()
        if self.kv_events is not None and self.engine.kv_events is not None:
            self.kv_events.serve_replays()
            self.kv_events.publish(self.engine.kv_events.take())  # this iteration's, as one batch

    def _on_worker(self, peer: bytes, message: Any, fd: int | None) -> None:
        self.frontends.publish(self.workers.on_message(peer, message, fd))

    def stop(self, *_: object) -> None:
        """Leave the loop after the current iteration (a signal handler)."""
        self.stopping = True

    def close(self) -> None:
        """Close every socket."""
        self.monitor.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.context.destroy(linger=0)


def _drain(
    channel: Channel,
    handler: Callable[[bytes, Any, int | None], None],
    bad: Callable[[str], None],
) -> None:
    """Handle every message already queued on one socket, without blocking."""
    while channel.waiting():
        try:
            peer, message, fd = channel.recv_with_fd()
        except BadMessage as exc:
            bad(f"peer {exc.peer!r}: {exc}")
            continue
        if peer is not None:  # a ROUTER always names the peer
            handler(peer, message, fd)


def run_scheduler(
    *,
    config: SchedulerConfig,
    addresses: Addresses,
    heartbeat_s: float = 0.5,
    worker_timeout: float = 60.0,
) -> int:
    """Entry function of the scheduler process.

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
