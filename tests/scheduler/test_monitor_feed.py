"""The scheduler's monitor feed: nothing is built while nobody subscribes; a subscriber gets
snapshots a few times a second, with the pool, the queues, health (the worker's plan too),
events and their own pacing."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from protocol.addresses import Addresses, runtime_dir
from protocol.messages import PROTOCOL_VERSION, AddRequest, SamplingParams
from protocol.monitor import FREE, HELD, PoolSnapshot
from scheduler.config import SchedulerConfig
from scheduler.process import SchedulerProcess
from tests.faults.raw import ENCODE, announcement, dealer


@pytest.fixture
def scheduler():
    """A scheduler process's loop in a thread, on private ipc sockets."""
    run = f"mon-{uuid.uuid4().hex[:8]}"
    directory = runtime_dir()
    addresses = Addresses(
        frontend=f"ipc://{directory}/{run}-frontend.sock",
        worker=f"ipc://{directory}/{run}-worker.sock",
        monitor=f"ipc://{directory}/{run}-monitor.sock",
    )
    process = SchedulerProcess(config=SchedulerConfig(audit=True), addresses=addresses)
    thread = threading.Thread(target=process.run, daemon=True)
    thread.start()
    context = zmq.Context()
    try:
        yield process, addresses, context
    finally:
        process.stop()
        thread.join(5)
        process.close()
        context.destroy(linger=0)
        for address in (addresses.frontend, addresses.worker, addresses.monitor):
            Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


def snapshots(socket: zmq.Socket, seconds: float) -> list[PoolSnapshot]:
    decoder = msgspec.msgpack.Decoder(PoolSnapshot)
    found, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if socket.poll(int(left * 1000) + 1):
            found.append(decoder.decode(socket.recv()))
    return found


def first_snapshot(socket: zmq.Socket, wanted, seconds: float = 20.0) -> PoolSnapshot:
    """The first snapshot that satisfies `wanted`; a loaded CI machine may take a few frames."""
    decoder = msgspec.msgpack.Decoder(PoolSnapshot)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if socket.poll(int(left * 1000) + 1):
            snapshot = decoder.decode(socket.recv())
            if wanted(snapshot):
                return snapshot
    raise AssertionError(f"no snapshot satisfied the condition within {seconds} s")


def test_snapshots_flow_only_while_subscribed(scheduler):
    process, addresses, context = scheduler
    time.sleep(0.6)
    assert process.monitor.sent == 0, "built snapshots nobody asked for"
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(addresses.monitor)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    first = snapshots(sub, 1.5)
    assert first, "no snapshot after subscribing"
    assert first[-1].pool is None and first[-1].health.worker == "none"
    assert first[-1].protocol_version == PROTOCOL_VERSION

    worker = dealer(context, addresses.worker, b"raw-worker")
    plan = {"attention": "sdpa", "kv_dtype": "float16", "threads": "3"}
    worker.send(ENCODE(msgspec.structs.replace(announcement(PROTOCOL_VERSION), plan=plan)))
    # A request sent before the scheduler has read the worker's WorkerReady is refused (no
    # worker yet); a real frontend waits for SchedulerInfo, this one for the feed to say so.
    first_snapshot(sub, lambda snapshot: snapshot.health.worker == "ready")
    frontend = dealer(context, addresses.frontend)
    params = SamplingParams(max_tokens=4)
    frontend.send(ENCODE(AddRequest(request_id="req-1", prompt_token_ids=[5] * 20, params=params)))
    last = first_snapshot(sub, lambda snapshot: bool(snapshot.requests))
    assert last.health.worker == "ready" and last.health.model_id == "raw"
    assert last.health.plan == plan  # as the worker announced it
    cadence = last.cadence  # how the monitor paces the feed, for the page to judge it by
    assert (cadence.interval_s, cadence.max_gap_s) == (0.25, 1.0) and cadence.gap_s > 0
    assert last.pool is not None and last.pool.num_blocks == 8
    (row,) = last.requests
    assert row.request_id == "req-1" and row.running and row.num_blocks == 2
    assert len(row.blocks) == 2  # one byte per block: its two held, the rest free
    assert sorted(b for b, state in enumerate(last.pool.states) if state == HELD) == row.blocks
    assert last.pool.states.count(FREE) == 6
    assert any(e.kind == "worker" and "ready" in e.text for e in last.events)
    later = snapshots(sub, 1.5)
    assert len(later) <= 1.5 / process.monitor.interval_s + 2, "more than a few per second"

    sub.setsockopt(zmq.UNSUBSCRIBE, b"")
    time.sleep(0.3)
    sent = process.monitor.sent
    time.sleep(1.0)
    assert process.monitor.sent == sent, "still publishing after the last subscriber left"
