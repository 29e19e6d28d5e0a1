"""PageFeed: relays the scheduler's monitor feed and the plots' history to open web pages.

One SUB socket on the scheduler's monitor XPUB, subscribed only while some page is open (so the
scheduler builds nothing for a server nobody watches). Each snapshot's pool is turned into runs
(``frontend.pool_runs``) and the whole into JSON once, and handed to every page's ``Watcher``,
a bounded queue that drops its oldest frame when the page falls behind: a slow or stalled
browser misses frames, and never holds more than ``depth`` of them here. A sample of the plots'
figures goes out once a second (``History``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from frontend.client import SchedulerClient
from frontend.config import FrontendConfig
from frontend.metrics import Metrics
from frontend.page_history import History
from frontend.pool_runs import pool_runs
from protocol.messages import PROTOCOL_VERSION
from protocol.monitor import STATES, PoolSnapshot

log = logging.getLogger(__name__)


class Watcher:
    """One open page's frames, oldest dropped first when more than ``depth`` wait."""

    def __init__(self, depth: int) -> None:
        self.frames: deque[bytes] = deque(maxlen=depth)
        self.dropped = 0
        self._ready = asyncio.Event()

    def push(self, frame: bytes) -> None:
        """Queue a frame (dropping the oldest when full) without ever waiting."""
        if len(self.frames) == self.frames.maxlen:
            self.dropped += 1
        self.frames.append(frame)
        self._ready.set()

    async def next(self) -> list[bytes]:
        """Every frame queued, once at least one is."""
        await self._ready.wait()
        self._ready.clear()
        frames = list(self.frames)
        self.frames.clear()
        return frames


class PageFeed:
    """The monitor subscription, the open pages and the plots' history."""

    def __init__(
        self,
        config: FrontendConfig,
        client: SchedulerClient,
        metrics: Metrics,
        *,
        max_watchers: int = 32,
        depth: int = 4,
        period_s: float = 1.0,
    ) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.max_watchers = max_watchers
        self.depth = depth
        self.period_s = period_s
        self.history = History(client, metrics)
        self.watchers: set[Watcher] = set()
        self.latest: tuple[float, bytes] | None = None  # (monotonic time, frame)
        self._decoder = msgspec.msgpack.Decoder(PoolSnapshot)
        self._encoder = msgspec.json.Encoder()
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        count = config.api_servers
        self._frontend = f"{config.api_server_index + 1} of {count}" if count > 1 else None

    async def start(self) -> None:
        """Connect to the monitor feed (when configured) and start sampling."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._tick(), name="page-history"))
        address = self.config.addresses.monitor
        if address is None:
            return
        self._context = zmq.asyncio.Context()
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, 8)
        socket.connect(address)
        self._socket = socket
        self._tasks.append(loop.create_task(self._listen(), name="page-feed"))

    async def close(self) -> None:
        """Stop the tasks and close the socket."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = self._socket = None

    # -- pages ---------------------------------------------------------------------------------

    def watch(self) -> Watcher | None:
        """A new page's watcher, with the history and the latest snapshot queued; None when
        ``max_watchers`` pages are open already."""
        if len(self.watchers) >= self.max_watchers:
            return None
        if not self.watchers and self._socket is not None:
            self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        watcher = Watcher(self.depth)
        watcher.push(self._frame("hello", self._hello()))
        if self.latest is not None and time.monotonic() - self.latest[0] < 2.0:
            watcher.push(self.latest[1])
        self.watchers.add(watcher)
        self.metrics.page_streams.set(len(self.watchers))
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """A page went away; the last one to go ends the subscription."""
        self.watchers.discard(watcher)
        self.metrics.page_streams.set(len(self.watchers))
        self.metrics.page_frames_dropped.inc(watcher.dropped)
        watcher.dropped = 0
        if not self.watchers and self._socket is not None:
            self._socket.setsockopt(zmq.UNSUBSCRIBE, b"")
            self.latest = None

    def _hello(self) -> dict:
        return {
            "protocol_version": PROTOCOL_VERSION,
            "states": STATES,
            "feed": self._socket is not None,
            "period_s": self.period_s,
            "history": list(self.history.samples),
            "link": self._link(),
        }

    def _link(self) -> dict:
        """This frontend's own view of the scheduler, sent every ``period_s`` whether or not
        snapshots come: a page tells a scheduler that throttles its snapshots (``alive``, heard
        lately) from one that is gone, and knows the worker's state from ``SchedulerInfo``."""
        client = self.client
        now = time.monotonic()
        heard, info, latest = client.last_heard, client.info, self.latest
        return {
            "state": client.link.value,
            "problem": client.unavailable_reason(),
            "heard_s": None if heard is None else round(now - heard, 2),
            "in_flight": client.num_in_flight,
            "pages": len(self.watchers),  # this frontend's
            # One of several (--api-servers): the plots' tokens/s and latencies are its own.
            "frontend": self._frontend,
            "alive": client.alive,  # heard within the frontend's scheduler_timeout
            "worker_ready": None if info is None else info.worker_ready,
            "worker_reason": "" if info is None else info.reason,
            # since this frontend's latest snapshot (None: none since a page opened)
            "snapshot_age_s": None if latest is None else round(now - latest[0], 2),
        }

    def _frame(self, event: str, data: Any) -> bytes:
        return b"event: " + event.encode() + b"\ndata: " + self._encoder.encode(data) + b"\n\n"

    def _fan_out(self, frame: bytes) -> None:
        for watcher in self.watchers:
            watcher.push(frame)

    # -- background tasks ----------------------------------------------------------------------

    async def _listen(self) -> None:
        socket = self._socket
        while socket is not None:
            payload = await socket.recv()
            try:
                snapshot = self._decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.metrics.bad_messages.inc()
                log.warning("dropped a bad monitor frame: %s", exc)
                continue
            if snapshot.protocol_version != PROTOCOL_VERSION or not self.watchers:
                continue  # the page learns of another version from /health's reason
            try:
                view = page_view(snapshot)
            except ValueError as exc:
                self.metrics.bad_messages.inc()
                log.warning("dropped a monitor frame whose pool does not add up: %s", exc)
                continue
            frame = self._frame("snapshot", view)
            self.latest = (time.monotonic(), frame)
            self._fan_out(frame)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            sample = self.history.sample()
            if self.watchers:
                self._fan_out(self._frame("stats", {"sample": sample, "link": self._link()}))


def page_view(snapshot: PoolSnapshot) -> dict:
    """A snapshot as a page gets it: the pool as runs (``frontend.pool_runs``), the rows
    without their block lists (the runs carry them)."""
    view = plain(snapshot)
    if snapshot.pool is not None:
        view["pool"] = plain(pool_runs(snapshot.pool, snapshot.requests))
    for row in view["requests"]:
        del row["blocks"]
    return view


def plain(value: Any) -> Any:
    """A snapshot as JSON-ready dicts and lists (its structs travel as arrays on the wire)."""
    if isinstance(value, msgspec.Struct):
        return {name: plain(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list) and value and isinstance(value[0], (msgspec.Struct, list)):
        return [plain(item) for item in value]
    return value
