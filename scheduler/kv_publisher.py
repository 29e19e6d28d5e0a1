"""KvPublisher: the scheduler process's KV events on ZeroMQ, as vLLM publishes them.

Once an iteration the process hands it the events its ``KvEventLog`` collected; when there are
any, they go out as one ``KVEventBatch`` on a PUB socket, as three frames: the topic, the
sequence number (8 bytes, big-endian, from 0 and one more per batch) and the msgpack batch
(``protocol.kv_events``). The last ``buffer_batches`` batches are kept, so a subscriber that sees
a gap in the numbers can ask the replay ROUTER for everything from a number on and gets each
kept batch as ``(seq, payload)``, then ``(-1, b"")``. A batch older than the buffer is gone: such
a subscriber starts again from the next AllBlocksCleared or from nothing, as with vLLM.

The endpoint means what it means to vLLM: a ``*`` or ``::`` host, or ipc, binds; any other host
is a collector's that we connect to (llm-d's indexer may bind one). The replay socket binds.
Publishing never blocks the loop: a PUB socket drops for a subscriber that is ``hwm`` behind.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from protocol.kv_events import END_OF_REPLAY, KVEvent, KVEventBatch

log = logging.getLogger("nanoserve.scheduler")


def binds(endpoint: str) -> bool:
    """Whether a publisher binds ``endpoint`` (else it connects to it), as vLLM decides."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvPublisher:
    """The PUB socket, the replay ROUTER and the buffer of recent batches."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.bind(endpoint) if binds(endpoint) else self.pub.connect(endpoint)
        self.replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as the next batch (nothing when there are none)."""
        if not events:
            return
        seq = self.next_seq
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self._buffer.append((seq, payload))
        self.next_seq += 1

    def serve_replays(self) -> None:
        """Answer every replay request already queued, without blocking."""
        if self.replay is None:
            return
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: dropped a replay request of %d frames", len(frames))
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in self._buffer:
                if seq >= start:
                    self.replay.send_multipart((peer, b"", seq.to_bytes(8, "big"), payload))
            end = END_OF_REPLAY.to_bytes(8, "big", signed=True)
            self.replay.send_multipart((peer, b"", end, b""))

    def close(self) -> None:
        """Close both sockets."""
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
