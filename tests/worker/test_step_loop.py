"""The worker process's step loop (``worker.process._serve`` with ``worker.step.loop``) on real
sockets: with the device still busy on step N it launches step N+1 (two in flight), answers
each step once and in order when its sampled ids are back, answers a refused step with an
error in its turn, and answers every step sent before a SchedulerHello before it announces
itself again."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from protocol.channel import Channel
from protocol.messages import (
    PENDING_TOKEN,
    SamplingParams,
    SchedulerHello,
    SchedulerToWorker,
    Shutdown,
    StepInput,
    StepItem,
    StepResult,
    WorkerReady,
    WorkerToScheduler,
)
from tests.worker.conftest import make_worker
from worker import process
from worker.step.fences import FENCES, Fence


class GatedFence(Fence):
    """The device's work, done only once the test opens the gate (a busy GPU, on the CPU)."""

    gate = threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self) -> None:
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened the gate")


def fresh(rid: str, slot: int, blocks: list[int]) -> StepItem:
    return StepItem(
        request_id=rid,
        slot=slot,
        new_blocks=blocks,
        token_ids=[1, 5, 6],
        start=0,
        params=SamplingParams(temperature=0.0),
        prompt_len=3,
        fresh=True,
    )


def decode(rid: str, slot: int, start: int) -> StepItem:
    return StepItem(
        request_id=rid, slot=slot, new_blocks=[], token_ids=[PENDING_TOKEN], start=start
    )


def recv(channel: Channel, timeout_s: float = 30.0):
    if not channel.socket.poll(int(timeout_s * 1000)):
        raise TimeoutError("no message from the worker")
    return channel.recv()[1]


def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.005)


@pytest.fixture
def sockets(tmp_path):
    context = zmq.Context()
    scheduler, worker_side = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for socket in (scheduler, worker_side):
        socket.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/worker"
    scheduler.bind(address)
    worker_side.setsockopt(zmq.ROUTING_ID, b"w")
    worker_side.connect(address)
    yield Channel(scheduler, WorkerToScheduler), Channel(worker_side, SchedulerToWorker)
    scheduler.close(0)
    worker_side.close(0)
    context.term()


def test_two_steps_in_flight_answered_in_order(tiny_dir, sockets, monkeypatch):
    monkeypatch.setitem(FENCES, "cpu", GatedFence)
    GatedFence.gate.clear()
    worker = make_worker(tiny_dir, num_slots=2, num_blocks=8)
    scheduler, channel = sockets
    stopping: list[int] = []
    codes: list[int] = []
    serving = threading.Thread(
        target=lambda: codes.append(process._serve(channel, worker, stopping, 0.05, 0.0)),
        daemon=True,
    )
    channel.send(worker.ready())
    recv(scheduler)  # the peer is known now: the scheduler can address it
    serving.start()
    try:
        scheduler.send(StepInput(step_id=0, items=[fresh("a", 0, [0, 1])]), b"w")
        scheduler.send(StepInput(step_id=1, items=[decode("a", 0, 3)]), b"w")
        until(lambda: worker.in_flight == 2)  # step 1 launched while step 0 still runs
        assert not scheduler.socket.poll(50)  # and nothing answered while the device is busy
        GatedFence.gate.set()
        first, second = recv(scheduler), recv(scheduler)
        assert (first.step_id, second.step_id) == (0, 1)
        assert len(first.samples) == len(second.samples) == 1 and first.resident_bytes > 0
        assert worker.row_table.rows[0].history[3] == first.samples[0].token_id

        scheduler.send(StepInput(step_id=2, items=[decode("a", 0, 4)]), b"w")
        scheduler.send(StepInput(step_id=3, items=[fresh("b", 9, [2])]), b"w")  # slot 9 of 2
        scheduler.send(SchedulerHello(), b"w")
        answers = [recv(scheduler) for _ in range(3)]
        assert [type(a) for a in answers] == [StepResult, StepResult, WorkerReady]
        assert answers[0].step_id == 2 and answers[0].error is None
        assert answers[1].step_id == 3 and "slot 9 out of range" in answers[1].error
        assert all(row.request_id is None for row in worker.rows())  # the Hello emptied them

        scheduler.send(Shutdown(reason="test"), b"w")
        serving.join(30)
        assert codes == [0]
    finally:
        GatedFence.gate.set()
        stopping.append(15)
        serving.join(30)
