"""One small helper that owns a ZeroMQ socket, its msgspec encoder and its typed decoder.

Every socket in nanoserve is either a ROUTER (bound by the scheduler; frames are
``[peer_identity, payload]``) or a DEALER (frontends and the worker; frames are ``[payload]``).
The same class serves both, blocking or asyncio (``zmq.asyncio`` sockets). A frame that does not
decode into the socket's union raises ``BadMessage``: callers log it, count it and carry on.
No other module encodes or decodes a wire message.

``watch`` reads a plain socket from an asyncio loop with one reader callback on the socket's
file descriptor, no future and no task per message: on a busy machine each message arrives
with cold caches, and ``zmq.asyncio``'s per-message futures and reader registrations cost
more than everything else the frontend does with a token (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq

log = logging.getLogger(__name__)

T = TypeVar("T")

# Plain ints: pyzmq's enum members make each ``&`` an enum construction.
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class BadMessage(Exception):
    """A frame that is not a valid message for this socket (garbage, truncated, wrong type)."""

    def __init__(self, reason: str, peer: bytes | None) -> None:
        super().__init__(reason)
        self.peer = peer


class Channel(Generic[T]):
    """Typed messages over one socket. ``inbox`` is the union this socket may receive."""

    def __init__(self, socket: zmq.Socket, inbox: Any) -> None:
        self.socket = socket
        self.is_router = socket.type == zmq.ROUTER
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(inbox)
        self._loop: asyncio.AbstractEventLoop | None = None  # set while ``watch`` reads it
        self._on_message: Callable[[bytes | None, T], None] | None = None
        self._on_bad: Callable[[BadMessage], None] | None = None

    def _frames(self, message: msgspec.Struct, peer: bytes | None) -> list[bytes]:
        payload = self._encoder.encode(message)
        if self.is_router:
            if peer is None:
                raise ValueError("a ROUTER channel needs the peer identity to send to")
            return [peer, payload]
        return [payload]

    def _decode(self, frames: list[bytes]) -> tuple[bytes | None, T]:
        peer = frames[0] if self.is_router and len(frames) == 2 else None
        if len(frames) != (2 if self.is_router else 1):
            raise BadMessage(
                f"expected {2 if self.is_router else 1} frames, got {len(frames)}", peer
            )
        try:
            return peer, self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadMessage(str(exc), peer) from None

    def send(self, message: msgspec.Struct, peer: bytes | None = None) -> None:
        """Send without blocking the caller's loop (ROUTER drops frames for unknown peers)."""
        self.socket.send_multipart(self._frames(message, peer), copy=False)

    def try_send(self, message: msgspec.Struct, peer: bytes | None = None) -> bool:
        """Queue ``message`` now or drop it: False when the socket cannot take it (no connected
        peer under ``IMMEDIATE``, or the high-water mark reached). Never blocks, blocking socket
        or ``zmq.asyncio``. On an asyncio socket a DONTWAIT send resolves at once, so no send is
        ever left pending, and unlike a send through a shadow socket it keeps the asyncio
        socket's edge-triggered read wake-ups intact."""
        frames = self._frames(message, peer)
        try:
            sent = self.socket.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
        except zmq.Again:
            return False
        finally:
            if self._loop is not None:
                # A send can take the edge that announced a message (see ``_drain``).
                self._loop.call_soon(self._drain)
        if not asyncio.isfuture(sent):
            return True
        if not sent.done():  # cannot happen with DONTWAIT; never leave one dangling
            sent.cancel()
            return False
        error = sent.exception()
        if error is not None and not isinstance(error, zmq.Again):
            raise error
        return error is None

    def recv(self) -> tuple[bytes | None, T]:
        """Receive one message as ``(peer, message)``; peer is None on a DEALER."""
        return self._decode(self.socket.recv_multipart())

    def waiting(self) -> bool:
        """Whether a message is queued now (never blocks; a getsockopt, not a poll)."""
        return bool(self.socket.getsockopt(_EVENTS) & _POLLIN)

    def recv_with_fd(self) -> tuple[bytes | None, T, int | None]:
        """``recv``, plus the file descriptor of the connection the message arrived on (None
        where libzmq cannot tell): what matches a socket monitor's disconnect event to a peer.
        BadMessage as ``recv``."""
        frames = self.socket.recv_multipart(copy=False)
        peer, message = self._decode([frame.bytes for frame in frames])
        return peer, message, _source_fd(frames[-1])

    def watch(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[bytes | None, T], None],
        on_bad: Callable[[BadMessage], None],
    ) -> None:
        """Call ``on_message(peer, message)`` in ``loop`` for every message, as it arrives, and
        ``on_bad`` for every frame that does not decode. The socket must be a plain one (not
        ``zmq.asyncio``: its own reader would replace this one), and every send on it must go
        through ``try_send`` while watched. ``unwatch`` before closing the socket."""
        self._loop, self._on_message, self._on_bad = loop, on_message, on_bad
        loop.add_reader(self.socket.FD, self._drain)
        loop.call_soon(self._drain)  # what arrived before the reader was added

    def unwatch(self) -> None:
        """Stop ``watch``: no callback runs after this returns."""
        if self._loop is not None:
            self._loop.remove_reader(self.socket.FD)
            self._loop = self._on_message = self._on_bad = None

    def _drain(self) -> None:
        """Deliver every queued message. ZeroMQ's file descriptor is edge-triggered: it becomes
        readable when the socket's state changes, not while a message waits, so each wake-up
        reads while the socket's events say one waits. Any operation on the socket may take
        the edge of a message it did not read (``try_send`` therefore drains after sending).
        So a callback that raises is logged and the drain goes on: the messages behind it would
        otherwise wait for an edge that may never come."""
        while self._loop is not None and self.waiting():
            frames = self.socket.recv_multipart()
            try:
                peer, message = self._decode(frames)
            except BadMessage as exc:
                self._on_bad(exc)
                continue
            try:
                self._on_message(peer, message)
            except Exception:
                log.exception(
                    "the handler of a %s failed; later messages still come", type(message).__name__
                )

    async def asend(self, message: msgspec.Struct, peer: bytes | None = None) -> None:
        """``send`` for a ``zmq.asyncio`` socket."""
        await self.socket.send_multipart(self._frames(message, peer), copy=False)

    async def arecv(self) -> tuple[bytes | None, T]:
        """``recv`` for a ``zmq.asyncio`` socket."""
        return self._decode(await self.socket.recv_multipart())


def _source_fd(frame: zmq.Frame) -> int | None:
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:  # a libzmq without the (deprecated) property
        return None
