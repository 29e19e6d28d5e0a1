"""KV events from real processes, read by a subscriber written only from vLLM's published format
(``vllm/distributed/kv_events.py``: three frames, topic, 8-byte big-endian sequence number,
msgpack of array-like tagged structs; a ROUTER replay socket answering a start number with
``(seq, payload)`` frames and ``-1``). Nothing below imports nanoserve's own event types.

The default model behind the three processes, a pool of 40 blocks so that a multi-turn run
evicts: replaying every batch rebuilds the scheduler's set of cached hashes (as many as the
pool's cached-free blocks once nothing runs). One batch is dropped on purpose and recovered
through the replay socket. A SIGKILLed worker publishes AllBlocksCleared.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid

import aiohttp
import msgspec
import pytest
import zmq

from nanoserve.bench.chat import MultiTurn, build_conversations
from nanoserve.bench.serve import BenchServeConfig
from protocol.addresses import default_addresses, runtime_dir
from protocol.monitor import CACHED, PoolSnapshot
from tests.servers import start_server

pytestmark = pytest.mark.slow
TOPIC = b"kv@replica-0@SmolLM2-135M-Instruct"
DROPPED = 3  # the batch the subscriber pretends it never got


# -- vLLM's format, as its kv_events.py publishes it ----------------------------------------------
class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(Event):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A SUB on the events and a DEALER on the replay socket, in a thread: it applies batches in
    sequence order, and asks the replay socket for whatever it missed."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(EventBatch)
        self.hashes: set[int | bytes] = set()
        self.next_seq = 0
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.replayed: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sub.poll(50):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq == DROPPED and DROPPED not in self.replayed:
                continue  # lost on purpose: the next batch shows the gap
            if seq > self.next_seq:
                self._replay_from(self.next_seq)
            if seq == self.next_seq:
                self._apply(seq, payload)

    def _replay_from(self, start: int) -> None:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not self.replay.poll(5000):
                raise TimeoutError(f"no replay from {start}")
            _, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if seq == self.next_seq:
                self.replayed.append(seq)
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            self.counts[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            else:
                self.hashes.clear()
        self.next_seq = seq + 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.context.destroy(linger=0)


def _cached_blocks(context: zmq.Context, address: str) -> int:
    """The pool's cached-free blocks in the scheduler's next monitor snapshot."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(address)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if socket.poll(500):
                snapshot = msgspec.msgpack.decode(socket.recv(), type=PoolSnapshot)
                if snapshot.pool is not None and snapshot.num_running == 0:
                    return snapshot.pool.states.count(CACHED)
        raise TimeoutError("no monitor snapshot")
    finally:
        socket.close(linger=0)


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(0.05)


async def _multi_turn(url: str) -> dict:
    config = BenchServeConfig(
        base_url=url, endpoint_type="chat", dataset="multi-turn", prompt_format="text",
        output_len=8, request_timeout=120,
    )  # fmt: skip
    conversations = build_conversations(4, 3, system_len=120, turn_len=30, seed=5)
    async with aiohttp.ClientSession() as session:
        return await MultiTurn(config, conversations).run(session, "SmolLM2-135M-Instruct")


def test_a_vllm_subscriber_rebuilds_the_cache_and_recovers_a_missed_batch(tmp_path) -> None:
    run = uuid.uuid4().hex[:8]
    endpoint = f"ipc://{runtime_dir()}/kv-{run}.sock"
    replay = f"ipc://{runtime_dir()}/kv-{run}-replay.sock"
    subscriber = Subscriber(endpoint, replay)
    server = start_server(
        tmp_path, supervised=("worker",), audit=1, num_blocks=40, threads=1,
        kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
        kv_events_topic=TOPIC.decode(),
    )  # fmt: skip
    subscriber.thread.start()
    try:
        report = asyncio.run(_multi_turn(server.url))
        assert report["failed"] == 0 and report["completed"] == 12
        context = zmq.Context()
        try:
            monitor = default_addresses(server.run_id).monitor
            _until(lambda: len(subscriber.hashes) == _cached_blocks(context, monitor), "rebuild")
        finally:
            context.destroy(linger=0)
        assert subscriber.counts["BlockRemoved"] > 0, "a pool of 40 blocks evicts"
        assert DROPPED in subscriber.replayed
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in subscriber.hashes)

        os.kill(server.child_pid("worker"), signal.SIGKILL)
        _until(lambda: subscriber.counts["AllBlocksCleared"] > 0, "AllBlocksCleared")
        assert subscriber.hashes == set()
        server.wait_healthy()
    finally:
        subscriber.close()
        server.stop()
        for address in (endpoint, replay):
            if os.path.exists(address.removeprefix("ipc://")):
                os.unlink(address.removeprefix("ipc://"))
