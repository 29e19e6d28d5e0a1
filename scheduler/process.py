"""The scheduler process: the Engine's loop, with the worker and the frontends on sockets.

It binds two ROUTER sockets (frontends connect to one, the worker to the other) and never
blocks on the worker: while a step is in flight it keeps taking AddRequest and Abort. An Abort
that lands mid-step is applied to the ledgers at once; the step's sample for that request is
then ignored when the result arrives, so no block leaks and no token reaches a dead request.

Life of one iteration: plan() -> send StepInput -> (adds, aborts, heartbeats) -> StepResult ->
apply() -> audit (with --audit) -> Outputs to each frontend -> plan() again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

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
    StepInput,
    StepResult,
    WorkerReady,
    WorkerToScheduler,
)

log = logging.getLogger("nanoserve.scheduler")


@dataclass
class _Worker:
    """The one worker we step, as the scheduler sees it."""

    peer: bytes
    ready: WorkerReady
    last_seen: float
    in_flight: StepInput | None = None
    busy_s: float = 0.0


@dataclass
class _Counters:
    bad_messages: int = 0
    steps: int = 0
    messages_during_step: int = 0  # frontend messages taken in while the worker computed
    scheduler_s: float = 0.0  # time spent planning and applying, not waiting on the worker
    frontends: dict[bytes, float] = field(default_factory=dict)


class SchedulerProcess:
    """State and message handlers of the scheduler process; ``run`` is its loop."""

    def __init__(self, *, config, addresses: Addresses, heartbeat_s: float = 0.5) -> None:
        self.config = config
        self.heartbeat_s = heartbeat_s
        self.context = zmq.Context()
        self.frontends: Channel = Channel(self._bind(addresses.frontend), FrontendToScheduler)
        self.workers: Channel = Channel(self._bind(addresses.worker), WorkerToScheduler)
        self.engine = None  # built when the first worker announces its geometry
        self.worker: _Worker | None = None
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self.counters = _Counters()
        self._last_heartbeat = 0.0

    def _bind(self, address: str) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its identity
        socket.bind(address)
        return socket

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until interrupted."""
        poller = zmq.Poller()
        poller.register(self.frontends.socket, zmq.POLLIN)
        poller.register(self.workers.socket, zmq.POLLIN)
        while True:
            idle = self.worker is None or self.worker.in_flight is not None or not self._has_work()
            events = dict(poller.poll(int(self.heartbeat_s * 1000) if idle else 0))
            if self.frontends.socket in events:
                self._drain(self.frontends, self._on_frontend)
            if self.workers.socket in events:
                self._drain(self.workers, self._on_worker)
            self._maybe_step()
            self._maybe_heartbeat()

    def close(self) -> None:
        """Close both sockets."""
        self.frontends.socket.close(0)
        self.workers.socket.close(0)
        self.context.term()

    def _drain(self, channel: Channel, handler) -> None:
        """Handle every message already queued on one socket, without blocking."""
        while channel.socket.poll(0):
            try:
                peer, message = channel.recv()
            except BadMessage as exc:
                self.counters.bad_messages += 1
                log.warning("dropped a bad message from peer %r: %s", exc.peer, exc)
                continue
            handler(peer, message)

    def _has_work(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished()

    def _maybe_step(self) -> None:
        """Send the next step if the worker is free and there is anything to do."""
        worker = self.worker
        if worker is None or worker.in_flight is not None or not self._has_work():
            return
        started = time.perf_counter()
        step = self.engine.plan()
        self.counters.scheduler_s += time.perf_counter() - started
        if step is None:
            return
        worker.in_flight = step
        self.workers.send(step, worker.peer)

    # -- frontends ---------------------------------------------------------------------------

    def _on_frontend(self, peer: bytes, message) -> None:
        known = peer in self.counters.frontends
        self.counters.frontends[peer] = time.monotonic()
        if self.worker is not None and self.worker.in_flight is not None:
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
        )

    def _add(self, peer: bytes, add: AddRequest) -> None:
        if self.engine is None:
            self._reply(peer, [_failed(add.request_id, "no worker is ready")])
            return
        try:
            self.engine.add_request(add.request_id, list(add.prompt_token_ids), add.params)
        except ValueError as exc:  # the frontend validates; this is the last line of defence
            self._reply(peer, [_failed(add.request_id, str(exc))])
            return
        self.owner[add.request_id] = peer

    def _abort(self, request_id: str) -> None:
        if self.engine is not None and request_id in self.owner:
            self.engine.abort(request_id)
        self.owner.pop(request_id, None)

    def _reply(self, peer: bytes, outputs: list[RequestOutput]) -> None:
        self.frontends.send(Outputs(outputs=outputs, stats=self._stats()), peer)

    # -- worker ------------------------------------------------------------------------------

    def _on_worker(self, peer: bytes, message) -> None:
        if self.worker is not None and peer == self.worker.peer:
            self.worker.last_seen = time.monotonic()
        match message:
            case WorkerReady():
                self._worker_ready(peer, message)
            case StepResult():
                self._step_done(peer, message)
            case Heartbeat():
                if self.worker is None or peer != self.worker.peer:
                    # A worker we do not know (we restarted, or it did): ask it to announce.
                    self.workers.send(SchedulerHello(), peer)

    def _worker_ready(self, peer: bytes, ready: WorkerReady) -> None:
        if ready.protocol_version != PROTOCOL_VERSION:
            log.error(
                "worker speaks protocol %d, this scheduler %d: refused",
                ready.protocol_version,
                PROTOCOL_VERSION,
            )
            return
        from scheduler.engine import Engine

        if self.engine is None:
            self.engine = Engine(ready, self.config)
        else:
            self.engine.worker_lost()  # running requests go back to waiting with their tokens
        self.worker = _Worker(peer=peer, ready=ready, last_seen=time.monotonic())
        log.info(
            "worker ready: %s, %d blocks of %d", ready.model_id, ready.num_blocks, ready.block_size
        )
        for frontend in self.counters.frontends:
            self.frontends.send(self._info(), frontend)

    def _step_done(self, peer: bytes, result: StepResult) -> None:
        worker = self.worker
        if worker is None or peer != worker.peer or worker.in_flight is None:
            return
        if result.step_id != worker.in_flight.step_id:
            log.warning("stale result for step %d dropped", result.step_id)
            return
        worker.in_flight = None
        worker.busy_s += result.forward_s
        self.counters.steps += 1
        started = time.perf_counter()
        if result.error is not None:
            log.error("worker refused step %d: %s; recomputing", result.step_id, result.error)
            self.engine.worker_lost()
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
        for frontend in self.counters.frontends:
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
            step_in_flight=self.worker is not None and self.worker.in_flight is not None,
            messages_during_step_total=self.counters.messages_during_step,
            scheduler_busy_s_total=self.counters.scheduler_s,
        )


def _failed(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, new_token_ids=[], finish_reason="error", error=reason
    )


def run_scheduler(*, config, addresses: Addresses, heartbeat_s: float = 0.5) -> int:
    """Entry function of the scheduler process. ``config`` is a scheduler.config.SchedulerConfig."""
    process = SchedulerProcess(config=config, addresses=addresses, heartbeat_s=heartbeat_s)
    try:
        return process.run()
    finally:
        process.close()
