"""Channel over real inproc sockets: try_send queues now or reports that it could not, on
blocking and zmq.asyncio sockets alike; a frame of the wrong kind is a BadMessage; ``watch``
delivers every message from an event loop's reader callback, even one whose wake-up another call
on the socket took."""

from __future__ import annotations

import asyncio
import select
import uuid

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol.channel import BadMessage, Channel
from protocol.messages import Abort, FrontendToScheduler, Heartbeat, SchedulerToFrontend


def _address() -> str:
    return f"inproc://channel-{uuid.uuid4().hex}"


def _beat(sender: str) -> bytes:
    """A Heartbeat as a ROUTER sends it to a frontend."""
    return msgspec.msgpack.encode(Heartbeat(sender=sender, time=0.0))


def _connected(context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket, bytes]:
    """A ROUTER and a DEALER connected to it, and the DEALER's identity at the ROUTER (learnt
    from one message, so the ROUTER can send to it)."""
    address = _address()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    dealer = _dealer(context)
    dealer.connect(address)
    dealer.send(_beat("hello"))
    assert router.poll(5000)
    peer, _ = router.recv_multipart()
    return router, dealer, peer


def _dealer(context: zmq.Context) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing is queued while no peer is connected
    return socket


def test_try_send_is_false_without_a_peer_and_true_once_one_listens() -> None:
    context = zmq.Context()
    try:
        address = _address()
        dealer = _dealer(context)
        sender: Channel[SchedulerToFrontend] = Channel(dealer, SchedulerToFrontend)
        assert sender.try_send(Abort(request_id="early")) is False  # not connected yet
        router = context.socket(zmq.ROUTER)
        router.bind(address)
        dealer.connect(address)
        receiver: Channel[FrontendToScheduler] = Channel(router, FrontendToScheduler)
        assert sender.try_send(Abort(request_id="r1")) is True
        assert router.poll(5000)
        assert receiver.waiting()
        peer, message = receiver.recv()
        assert message == Abort(request_id="r1") and peer is not None
        assert not receiver.waiting()
        assert sender.try_send(Heartbeat(sender="x", time=0.0)) is True
        with pytest.raises(ValueError, match="peer identity"):
            receiver.try_send(Heartbeat(sender="scheduler", time=0.0))
    finally:
        context.destroy(linger=0)


async def test_try_send_on_an_asyncio_socket_resolves_at_once() -> None:
    context = zmq.asyncio.Context()
    try:
        address = _address()
        router = context.socket(zmq.ROUTER)
        router.bind(address)
        dealer = _dealer(context)
        sender: Channel[SchedulerToFrontend] = Channel(dealer, SchedulerToFrontend)
        assert sender.try_send(Abort(request_id="early")) is False  # not connected yet
        dealer.connect(address)
        receiver: Channel[FrontendToScheduler] = Channel(router, FrontendToScheduler)
        assert sender.try_send(Abort(request_id="r1")) is True
        _, message = await receiver.arecv()
        assert message == Abort(request_id="r1")
        await router.send_multipart([b"nobody", b"garbage"])  # ROUTER drops unknown peers
        await dealer.send(b"\xc1")  # never valid msgpack
        with pytest.raises(BadMessage):
            await receiver.arecv()
    finally:
        context.destroy(linger=0)


async def test_watch_calls_back_for_every_message_and_bad_frame_then_stops() -> None:
    context = zmq.Context()
    loop = asyncio.get_running_loop()
    try:
        router, dealer, peer = _connected(context)
        receiver: Channel[SchedulerToFrontend] = Channel(dealer, SchedulerToFrontend)
        router.send_multipart([peer, _beat("before")])
        assert dealer.poll(5000)  # queued before the watch begins
        got: asyncio.Queue[object] = asyncio.Queue()
        receiver.watch(loop, lambda p, message: got.put_nowait(message), got.put_nowait)
        assert await asyncio.wait_for(got.get(), 5) == Heartbeat(sender="before", time=0.0)
        for index in range(3):  # a burst is read in one wake-up or several, never lost
            router.send_multipart([peer, _beat(f"r{index}")])
        router.send_multipart([peer, b"\xc1"])
        for index in range(3):
            assert await asyncio.wait_for(got.get(), 5) == Heartbeat(sender=f"r{index}", time=0.0)
        assert isinstance(await asyncio.wait_for(got.get(), 5), BadMessage)
        receiver.unwatch()
        router.send_multipart([peer, _beat("after")])
        assert dealer.poll(5000)
        await asyncio.sleep(0)  # a reader still registered would run in this turn
        assert got.empty()
    finally:
        context.destroy(linger=0)


async def test_watch_goes_on_after_a_callback_that_raises(caplog) -> None:
    """A failing callback is logged, and the messages queued behind it are still delivered in
    the same wake-up: the descriptor is edge-triggered, and no new edge may ever come."""
    context = zmq.Context()
    loop = asyncio.get_running_loop()
    got: asyncio.Queue[object] = asyncio.Queue()

    def on_message(peer: bytes | None, message: object) -> None:
        if message == Heartbeat(sender="boom", time=0.0):
            raise RuntimeError("a handler's bug")
        got.put_nowait(message)

    try:
        router, dealer, peer = _connected(context)
        receiver: Channel[SchedulerToFrontend] = Channel(dealer, SchedulerToFrontend)
        router.send_multipart([peer, _beat("boom")])
        router.send_multipart([peer, _beat("next")])
        assert dealer.poll(5000)  # takes the edge: only the watch's first drain reads them
        receiver.watch(loop, on_message, got.put_nowait)
        assert await asyncio.wait_for(got.get(), 5) == Heartbeat(sender="next", time=0.0)
        assert "the handler of a Heartbeat failed" in caplog.text
        assert "a handler's bug" in caplog.text
        receiver.unwatch()
    finally:
        context.destroy(linger=0)


async def test_watch_reads_a_message_whose_wake_up_another_call_took() -> None:
    """ZeroMQ's descriptor is edge-triggered: a call on the socket that processes its commands
    (a send, a poll) can take the edge of a message it does not read. The next ``try_send``
    makes the watch read it anyway."""
    context = zmq.Context()
    loop = asyncio.get_running_loop()
    try:
        router, dealer, peer = _connected(context)
        channel: Channel[SchedulerToFrontend] = Channel(dealer, SchedulerToFrontend)
        got: asyncio.Queue[object] = asyncio.Queue()
        channel.watch(loop, lambda p, message: got.put_nowait(message), got.put_nowait)
        for _ in range(3):  # the loop runs what it has queued: drains, readiness already seen
            await asyncio.sleep(0)
        router.send_multipart([peer, _beat("hidden")])
        assert dealer.poll(5000)  # takes the edge; the loop has not run since
        assert not select.select([dealer.FD], [], [], 0)[0]  # so no reader callback will run
        assert channel.try_send(Heartbeat(sender="f", time=1.0))
        assert await asyncio.wait_for(got.get(), 5) == Heartbeat(sender="hidden", time=0.0)
        channel.unwatch()
    finally:
        context.destroy(linger=0)
