"""KvPublisher: the scheduler process's KV events on ZeroMQ, as vLLM publishes them.

Once an iteration the process hands it the events its ``KvEventLog`` collected; when there are
any, they go out as one ``KVEventBatch`` on a PUB socket, as three frames: the topic, the
sequence number (8 bytes, big-endian, from 0 and one more per batch) and the msgpack batch
(``protocol.kv_events``; each event an array, or a tagged map for vLLM's newer consumers).
The last ``buffer_batches`` batches are kept, so a subscriber that sees
a gap in the numbers can ask the replay ROUTER for everything from a number on and gets each
kept batch as ``(seq, payload)``, then ``(-1, b"")``. A batch older than the buffer is gone: such
a subscriber starts again from the next AllBlocksCleared or from nothing, as with vLLM.

The endpoint binds where it can and connects where it must: a ``*`` or ``::`` host, ipc, or an
address of this host (``127.0.0.1``: subscribers on this host only) binds; an address this host
cannot bind, or one already bound here, is a collector's that we connect to (llm-d's indexer may
bind one). vLLM binds the first kind only, so ``tcp://127.0.0.1:5557`` binds here and connects
there. The replay socket binds. Publishing never blocks the loop: a PUB socket drops for a
subscriber that is ``hwm`` behind.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import msgspec
import zmq

from protocol.kv_events import END_OF_REPLAY, KVEvent, KVEventBatch, as_map

log = logging.getLogger("nanoserve.scheduler")


def bind_or_connect(socket: zmq.Socket, endpoint: str) -> str:
    """Bind ``socket`` to ``endpoint`` where this host can, else connect it; says which."""
    wildcard = "*" in endpoint or "::" in endpoint
    if wildcard or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
        return "bound"
    try:
        socket.bind(endpoint)
        return "bound"
    except zmq.ZMQError:  # not this host's address, or a collector's port here: connect
        socket.connect(endpoint)
        return "connected"


class KvPublisher:
    """The PUB socket, the replay ROUTER and the buffer of recent batches."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        form: str = "array",
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        how = bind_or_connect(self.pub, endpoint)
        log.info("KV events: publishing on %s (%s), topic %r", endpoint, how, topic)
        self.replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
        self.topic = topic.encode()
        self.form = form  # each event an array-like struct, or a tagged map (protocol.kv_events)
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as the next batch (nothing when there are none)."""
        if not events:
            return
        seq = self.next_seq
        if self.form == "map":
            payload = self._encoder.encode([time.time(), [as_map(event) for event in events]])
        else:
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
