"""FrontendSide: the scheduler process's dealings with the frontends it serves.

It owns the frontends' socket, the registry of frontends heard from, and which frontend owns
each request. It answers hellos, queues adds on the process's engine, applies each frontend's
aborts to its own requests, sends each frontend the outputs of its own requests, and beats to
every frontend with the gauges. Losing a frontend aborts its requests and no other's.
What happens on the worker's side reaches the frontends through ``publish``.
"""

from __future__ import annotations

import logging
import time

import msgspec

from protocol.channel import Channel
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
)
from protocol.params import RequestLimits, check_params
from scheduler.engine import Engine
from scheduler.peers import Frontends, failed
from scheduler.worker_side import WorkerNews, WorkerSide

log = logging.getLogger("nanoserve.scheduler")


class FrontendSide:
    """The frontends' socket, the frontends heard from, and the owner of every request."""

    def __init__(
        self, channel: Channel[FrontendToScheduler], engine: Engine, workers: WorkerSide
    ) -> None:
        self.channel = channel
        self.engine = engine
        self.workers = workers
        self.peers = Frontends()
        self.owner: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self.bad_messages = 0
        self.frontends_lost = 0
        self.messages_during_step = 0

    def stats(self) -> EngineStats:
        """Every gauge and counter: the worker side's, with this side's own."""
        base = self.workers.stats()
        return msgspec.structs.replace(
            base,
            bad_messages_total=base.bad_messages_total + self.bad_messages,
            frontends_lost_total=self.frontends_lost,
            messages_during_step_total=self.messages_during_step,
        )

    # -- messages ------------------------------------------------------------------------------

    def on_message(self, peer: bytes, message: FrontendToScheduler, fd: int | None) -> None:
        """Handle one message from a frontend."""
        known = self.peers.heard(peer, time.monotonic(), fd)
        if self.workers.steps_in_flight:
            self.messages_during_step += 1
        match message:
            case AddRequest():
                self._add(peer, message)
            case Abort():
                self._abort_from(peer, message.request_id)
            case FrontendHello():
                self._hello(peer, message)
            case Heartbeat():
                if not known:  # a frontend from before our restart: tell it who we are
                    self.channel.send(self.workers.info(), peer)

    def bad(self, what: str) -> None:
        """Count and log a message dropped from the frontends' socket."""
        self.bad_messages += 1
        log.warning("dropped a bad message from %s", what)

    def _hello(self, peer: bytes, hello: FrontendHello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self.bad_messages += 1
            log.error(
                "frontend %s speaks protocol %d, this scheduler %d: ignored",
                hello.frontend_id,
                hello.protocol_version,
                PROTOCOL_VERSION,
            )
            return
        self.channel.send(self.workers.info(), peer)

    def _add(self, peer: bytes, add: AddRequest) -> None:
        engine = self.engine
        if not self.workers.accepts_requests():
            self._reply(peer, [failed(add.request_id, self.workers.no_worker_reason)], ends=True)
            return
        if add.request_id in self.owner:
            self.bad(f"peer {peer!r}: request id {add.request_id!r} is already in use")
            return
        try:
            # The frontend checks the same; this is the last line of defence for a raw peer,
            # so that a poisonous request can never crash the worker over and over.
            limits = RequestLimits(vocab_size=engine.ready_info.vocab_size)
            check_params(add.params, add.prompt_token_ids, limits)
            engine.add_request(
                add.request_id, list(add.prompt_token_ids), add.params, add.cache_salt
            )
        except ValueError as exc:
            self._reply(peer, [failed(add.request_id, str(exc))], ends=True)
            return
        self.owner[add.request_id] = peer

    def _abort_from(self, peer: bytes, request_id: str) -> None:
        """A frontend's abort: of its own requests only (another frontend's is dropped)."""
        owner = self.owner.get(request_id)
        if owner is not None and owner != peer:
            self.bad(f"peer {peer!r}: abort of {request_id!r}, another frontend's request")
            return
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self.owner:
            self.engine.abort(request_id)
        self.owner.pop(request_id, None)

    # -- news for the frontends ----------------------------------------------------------------

    def publish(self, news: WorkerNews | None) -> None:
        """Pass on what happened on the worker's side: the new SchedulerInfo first, then
        failures, then outputs.

        The info goes first so that a frontend knows why before any client sees its request
        fail: a client that reads the error and then asks /health gets the same reason.
        """
        if news is None:
            return
        if news.changed:
            self.tell_all()
        if news.fail_reason is not None:
            self._fail_all(news.fail_reason)
        if news.outputs:
            self._route(news.outputs)

    def tell_all(self) -> None:
        """Send every frontend the current SchedulerInfo."""
        info = self.workers.info()
        for frontend in self.peers:
            self.channel.send(info, frontend)

    def heartbeat(self) -> None:
        """Send every frontend a heartbeat with the gauges."""
        beat = Heartbeat(sender="scheduler", time=time.time(), stats=self.stats())
        for frontend in self.peers:
            self.channel.send(beat, frontend)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Send each frontend the outputs of its own requests, finished ones forgotten."""
        by_peer: dict[bytes, list[RequestOutput]] = {}
        ended: set[bytes] = set()
        for output in outputs:
            peer = self.owner.get(output.request_id)
            if peer is None:
                continue  # aborted while its step was in flight
            by_peer.setdefault(peer, []).append(output)
            if output.finish_reason is not None:
                del self.owner[output.request_id]
                ended.add(peer)
        for peer, batch in by_peer.items():
            self._reply(peer, batch, ends=peer in ended)

    def _fail_all(self, reason: str) -> None:
        """Fail every request: each owner gets finish_reason "error" with ``reason``."""
        log.error("%s: failing %d requests", reason, len(self.owner))
        by_peer: dict[bytes, list[RequestOutput]] = {}
        for request_id, peer in self.owner.items():
            self.engine.abort(request_id)
            by_peer.setdefault(peer, []).append(failed(request_id, reason))
        self.owner.clear()
        for peer, batch in by_peer.items():
            self._reply(peer, batch, ends=True)

    def _reply(self, peer: bytes, outputs: list[RequestOutput], *, ends: bool) -> None:
        """Send ``outputs``; with the gauges when one of them ``ends`` its request. The gauges
        ride the heartbeat, at most one period old; at a request's end they come at once, so
        that /metrics read right after a reply counts it (its blocks back, its steps, its
        worker's memory). That is one stats() a finished request, not one a token."""
        stats = self.stats() if ends else None
        self.channel.send(Outputs(outputs=outputs, stats=stats), peer)

    # -- loss ----------------------------------------------------------------------------------

    def lost(self, peer: bytes, why: str) -> None:
        """Forget a frontend and abort its requests: nobody is left to read their tokens."""
        self.peers.forget(peer)
        self.frontends_lost += 1
        orphans = [request_id for request_id, owner in self.owner.items() if owner == peer]
        for request_id in orphans:
            self._abort(request_id)
        log.warning("frontend %r lost (%s): aborted its %d requests", peer, why, len(orphans))

    def fd_closed(self, fd: int) -> None:
        """A connection of the frontends' socket closed: lose the frontends it carried."""
        for peer in self.peers.on_fd(fd):
            self.lost(peer, "its connection closed")
