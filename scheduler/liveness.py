"""Liveness: how the scheduler process learns that a peer is gone, and shows it is not.

A socket monitor on each ROUTER reports a peer's disconnection at once (the file descriptor a
message arrived on says which peer it was), and silence longer than ``peer_timeout`` is the
backstop (an idle worker and every frontend heartbeat twice a second). A lost worker costs
recompute, not requests: its running requests wait for a worker to announce itself, and fail
after ``worker_timeout`` without one. A lost frontend's requests are aborted. The scheduler
sends every frontend a heartbeat with its gauges each ``heartbeat_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from scheduler.frontend_side import FrontendSide
from scheduler.worker_side import WorkerSide


class Liveness:
    """Socket monitors, silence checks and the scheduler's own heartbeats."""

    def __init__(
        self,
        frontends: FrontendSide,
        workers: WorkerSide,
        *,
        heartbeat_s: float,
        peer_timeout: float,
        worker_timeout: float,
    ) -> None:
        self.frontends = frontends
        self.workers = workers
        self.heartbeat_s = heartbeat_s
        self.peer_timeout = peer_timeout
        self.worker_timeout = worker_timeout
        closed = zmq.EVENT_DISCONNECTED
        self.monitors: dict[zmq.Socket, Callable[[int], None]] = {  # -> what a closed fd means
            frontends.channel.socket.get_monitor_socket(closed): frontends.fd_closed,
            workers.channel.socket.get_monitor_socket(closed): self._worker_fd_closed,
        }
        self._last_heartbeat = 0.0

    def register(self, poller: zmq.Poller) -> None:
        """Poll the monitor sockets with the process's own."""
        for monitor in self.monitors:
            poller.register(monitor, zmq.POLLIN)

    def on_events(self, events: dict) -> None:
        """Handle every disconnection the monitors reported in this poll's ``events``."""
        for monitor, on_closed in self.monitors.items():
            if monitor not in events:
                continue
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    on_closed(int(event["value"]))

    def check(self) -> None:
        """The backstop for a peer that went silent without closing its connection, and the
        deadline for a lost worker to come back."""
        now = time.monotonic()
        for peer, silent in self.frontends.peers.silent(now, self.peer_timeout):
            self.frontends.lost(peer, f"silent for {silent:.1f} s")
        workers = self.workers
        worker = workers.worker
        # Mid-step the beats come from a thread that Python code of the step can delay a little.
        limit = self.peer_timeout * (2 if workers.steps_in_flight else 1)
        if worker is not None and now - worker.last_seen > limit:
            self.frontends.publish(workers.lost(f"silent for {now - worker.last_seen:.1f} s"))
        lost = workers.lost_since
        if workers.worker is None and lost is not None and now - lost > self.worker_timeout:
            reason = f"no worker came back within {self.worker_timeout:g} s"
            self.frontends.publish(workers.give_up(reason))

    def maybe_heartbeat(self) -> None:
        """Beat to every frontend once each ``heartbeat_s``."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self.frontends.heartbeat()

    def _worker_fd_closed(self, fd: int) -> None:
        worker = self.workers.worker
        if worker is not None and worker.fd == fd:
            self.frontends.publish(self.workers.lost("its connection closed"))
