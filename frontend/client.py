"""SchedulerClient: the frontend's one DEALER connection to the scheduler.

A reader callback in the event loop (``Channel.watch``) routes each RequestOutput to the queue
of the HTTP request that owns it, so every request coroutine is woken with its own tokens only.
The client says hello on every (re)connection and every heartbeat period while it has not heard
from the scheduler, so a restarted scheduler learns about it. When the scheduler disconnects or
is silent past ``scheduler_timeout``, in-flight requests get ``SchedulerLost``, new ones 503.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.config import FrontendConfig
from frontend.geometry import Geometry
from frontend.metrics import Metrics
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
    SamplingParams,
    SchedulerInfo,
    SchedulerToFrontend,
)

log = logging.getLogger(__name__)


class Link(enum.Enum):
    """Where this frontend stands with the scheduler."""

    DISCONNECTED = "disconnected"  # no connection: none yet, or the socket monitor saw it close
    CONNECTED = "connected"  # connected; no SchedulerInfo yet, or none since it went silent
    REFUSED = "refused"  # its SchedulerInfo speaks another protocol version
    GREETED = "greeted"  # its SchedulerInfo speaks ours: ``info`` describes it


class SchedulerLost(Exception):
    """The scheduler went away while a request was in flight."""


Delivery = tuple[int, RequestOutput] | SchedulerLost
"""What a request's queue carries: ``(choice index, output)``, or the news that all is lost."""


class SchedulerClient:
    """Sends adds and aborts, routes outputs, and tracks the scheduler's liveness."""

    def __init__(self, config: FrontendConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.frontend_id = f"frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.link = Link.DISCONNECTED
        self.info: SchedulerInfo | None = None  # the scheduler's latest, refused or not
        self.stats = EngineStats()
        self.last_heard: float | None = None  # monotonic time of the scheduler's last message
        self.last_progress: float | None = None  # when steps last advanced (or nothing ran)
        self._routes: dict[str, tuple[int, asyncio.Queue[Delivery]]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._channel: Channel[SchedulerToFrontend] | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the monitor's and the heartbeat's
        self._ready = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, watch the socket, and start the monitor and heartbeat tasks."""
        self._context = zmq.asyncio.Context()
        # A plain socket for ``Channel.watch`` (a zmq.asyncio one registers its own reader on the
        # same descriptor); its monitor is read as a zmq.asyncio socket.
        socket = zmq.Context.shadow(self._context.underlying).socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a scheduler that is not connected: a stale AddRequest must never
        # reach a restarted scheduler after its HTTP request has already failed.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        socket.setsockopt(zmq.RCVHWM, 100_000)
        monitor = zmq.asyncio.Socket.from_socket(
            socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        )
        socket.connect(self.config.addresses.frontend)
        self._channel = Channel(socket, SchedulerToFrontend)
        loop = asyncio.get_running_loop()
        self._channel.watch(loop, self._on_message, self._on_bad_message)
        self._tasks = [
            loop.create_task(self._watch(monitor), name="scheduler-monitor"),
            loop.create_task(self._heartbeat(), name="scheduler-heartbeat"),
        ]

    async def close(self) -> None:
        """Stop the tasks and close the socket."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._channel is not None:  # made through a shadow context: destroy() misses it
            self._channel.unwatch()
            self._channel.socket.close(linger=0)
        if self._context is not None:
            # Every socket is closed with linger 0 by now (the monitor by ``_watch``), so
            # terminating can never block on undelivered messages.
            self._context.destroy(linger=0)
            self._context = None
        self._channel = None

    # -- state -------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """True while connected and heard from within ``scheduler_timeout``."""
        heard = self.last_heard
        timeout = self.config.scheduler_timeout
        connected = self.link is not Link.DISCONNECTED
        return connected and heard is not None and time.monotonic() - heard <= timeout

    def unavailable_reason(self) -> str | None:
        """Why requests cannot be served now, or None when they can."""
        if not self.alive:
            return "the scheduler is not connected"
        if self.info is None:
            return "waiting for the scheduler's SchedulerInfo"
        if self.link is Link.REFUSED:
            return f"scheduler speaks protocol {self.info.protocol_version}, not {PROTOCOL_VERSION}"
        if not self.info.worker_ready:
            return self.info.reason or "no worker is ready"
        return None

    def geometry(self) -> Geometry | None:
        """The worker's context length and pool size, or None while requests cannot be served."""
        if self.unavailable_reason() is not None or self.info is None:
            return None
        info = self.info
        return Geometry(info.model_id, info.max_model_len, info.num_blocks, info.block_size)

    async def wait_ready(self, timeout: float) -> None:
        """Wait until a worker is ready (TimeoutError after ``timeout`` seconds)."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def num_in_flight(self) -> int:
        """Scheduler requests this frontend is waiting on."""
        return len(self._routes)

    # -- requests ----------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue[Delivery],
        cache_salt: str | None = None,
    ) -> None:
        """Send one scheduler request; its outputs arrive on ``queue`` as ``(index, output)``.
        Only requests with equal ``cache_salt`` share cached prompt blocks."""
        if not self.alive:
            raise SchedulerLost("the scheduler is not connected")
        message = AddRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, params=params, cache_salt=cache_salt
        )
        self._routes[request_id] = (index, queue)
        if not self._send_now(message):
            self._routes.pop(request_id, None)
            raise SchedulerLost("could not send the request to the scheduler")

    def abort(self, request_id: str) -> None:
        """Forget a request and tell the scheduler to drop it (harmless if it already ended)."""
        if self._routes.pop(request_id, None) is not None:
            self._send_now(Abort(request_id=request_id))

    def _send_now(self, message: FrontendToScheduler) -> bool:
        """Send without waiting: False (message dropped) when no scheduler can take it now."""
        channel = self._channel
        return channel is not None and channel.try_send(message)

    # -- background tasks --------------------------------------------------------------------

    def _on_bad_message(self, exc: BadMessage) -> None:
        self.metrics.bad_messages.inc()
        log.warning("dropped a bad frame from the scheduler: %s", exc)

    def _on_message(self, _: bytes | None, message: SchedulerToFrontend) -> None:
        """Each message from the scheduler, in the event loop (``Channel.watch``)."""
        self.last_heard = time.monotonic()
        if self.link is Link.DISCONNECTED:  # a message can only come over a connection
            self.link = Link.CONNECTED
        match message:
            case Outputs():
                self._on_outputs(message)
                self._on_stats(message.stats)  # with the outputs that end a request
            case SchedulerInfo():
                self._on_info(message)
            case Heartbeat():
                self._on_stats(message.stats)  # the gauges ride the scheduler's beat
        if self.geometry() is not None:
            self._ready.set()
        else:
            self._ready.clear()

    def _on_outputs(self, message: Outputs) -> None:
        for output in message.outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted or failed here already
            if output.finish_reason is not None:
                del self._routes[output.request_id]
            route[1].put_nowait((route[0], output))

    def _on_stats(self, stats: EngineStats | None) -> None:
        if stats is None:
            return
        if stats.num_steps_total != self.stats.num_steps_total or stats.num_running == 0:
            self.last_progress = time.monotonic()
        self.stats = stats
        self.metrics.observe_stats(stats)

    def _on_info(self, info: SchedulerInfo) -> None:
        if info.protocol_version != PROTOCOL_VERSION:
            if self.link is not Link.REFUSED:
                log.error(
                    "scheduler protocol %d != frontend protocol %d: refusing it",
                    info.protocol_version,
                    PROTOCOL_VERSION,
                )
            self.link = Link.REFUSED
        else:
            known = self.info if self.link is Link.GREETED else None
            if known is None or known.worker_ready != info.worker_ready:
                state = "ready" if info.worker_ready else f"not ready ({info.reason})"
                log.info("scheduler: worker %s", state)
            self.link = Link.GREETED
            self.metrics.observe_info(info)
        self.info = info
        self.last_progress = time.monotonic()

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    if self.link is Link.DISCONNECTED:
                        self.link = Link.CONNECTED
                    await self._greet()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._lose("the scheduler disconnected", Link.DISCONNECTED)
        finally:
            monitor.close(linger=0)

    async def _greet(self) -> None:
        """Say hello until answered, briefly: the first tries may beat the ZMTP handshake
        (IMMEDIATE drops them); the heartbeat loop keeps trying after that."""
        for _ in range(50):
            if self.last_heard is not None or self._send_now(self._hello()):
                return
            await asyncio.sleep(0.01)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            now = time.monotonic()
            self._send_now(Heartbeat(sender=self.frontend_id, time=time.time()))
            quiet_for = now - self.last_heard if self.last_heard is not None else None
            if quiet_for is None or quiet_for > self.config.heartbeat_interval * 1.5:
                self._send_now(self._hello())  # a restarted scheduler learns about us
            if self.link in (Link.GREETED, Link.REFUSED) and not self.alive:
                self._lose("the scheduler stopped answering", Link.CONNECTED)

    def _hello(self) -> FrontendHello:
        return FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id=self.frontend_id)

    def _lose(self, reason: str, link: Link) -> None:
        """Fail every in-flight request and forget the scheduler's state. ``link`` is where that
        leaves the connection: DISCONNECTED when it closed, CONNECTED when it went silent."""
        if self.info is not None or self._routes:
            log.error("%s: failing %d in-flight requests", reason, len(self._routes))
        self.link = link
        self.info = None
        self.last_heard = None
        self._ready.clear()
        routes, self._routes = self._routes, {}
        for _, queue in routes.values():
            queue.put_nowait(SchedulerLost(reason))
