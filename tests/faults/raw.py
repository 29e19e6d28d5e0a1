"""Raw sockets: DEALERs that stand in for a frontend or a worker against a real scheduler, and a
ROUTER that stands in for the scheduler. They encode and decode messages themselves, so they can
send what no nanoserve peer would."""

from __future__ import annotations

import time

import msgspec
import zmq

from protocol.messages import SchedulerInfo, SchedulerToFrontend, WorkerReady

ENCODE = msgspec.msgpack.encode


def dealer(context: zmq.Context, address: str, identity: bytes | None = None) -> zmq.Socket:
    """A DEALER connected to ``address``, with ``identity`` as its routing id when given."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        socket.setsockopt(zmq.ROUTING_ID, identity)
    socket.connect(address)
    return socket


def bound_router(context: zmq.Context, address: str) -> zmq.Socket:
    """A ROUTER bound at ``address``: a raw scheduler that a real frontend or worker connects to."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    return socket


def received(socket: zmq.Socket, inbox: object, seconds: float) -> list:
    """Every message that reaches ``socket`` within ``seconds``, decoded as ``inbox``."""
    decoder = msgspec.msgpack.Decoder(inbox)
    messages = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if socket.poll(int(left * 1000) + 1):
            messages.append(decoder.decode(socket.recv()))
    return messages


def first_info(socket: zmq.Socket, seconds: float = 10.0) -> SchedulerInfo:
    """The next SchedulerInfo to reach a raw frontend (AssertionError after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for message in received(socket, SchedulerToFrontend, 0.2):
            if isinstance(message, SchedulerInfo):
                return message
    raise AssertionError(f"no SchedulerInfo within {seconds} s")


def announcement(version: int) -> WorkerReady:
    """A small worker's WorkerReady: 8 blocks of 16, 2 slots, a vocabulary of 100."""
    return WorkerReady(
        protocol_version=version,
        model_id="raw",
        num_blocks=8,
        block_size=16,
        num_slots=2,
        max_model_len=64,
        eos_token_ids=[0],
        vocab_size=100,
    )
