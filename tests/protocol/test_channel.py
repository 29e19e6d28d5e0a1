"""Channel over real inproc sockets: try_send queues now or reports that it could not, on
blocking and zmq.asyncio sockets alike, and a frame of the wrong kind is a BadMessage."""

from __future__ import annotations

import uuid

import pytest
import zmq
import zmq.asyncio

from protocol.channel import BadMessage, Channel
from protocol.messages import Abort, FrontendToScheduler, Heartbeat, SchedulerToFrontend


def _address() -> str:
    return f"inproc://channel-{uuid.uuid4().hex}"


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
        peer, message = receiver.recv()
        assert message == Abort(request_id="r1") and peer is not None
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
