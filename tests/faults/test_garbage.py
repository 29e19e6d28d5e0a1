"""Garbage on every socket: random bytes, truncated frames, extra frames, valid messages of the
wrong type and peers speaking another protocol version. Each is logged, counted and dropped, and
the process keeps serving. The scheduler is attacked through raw sockets on its two ROUTERs; the
worker and the frontend through a fake scheduler ROUTER they connect to."""

from __future__ import annotations

import asyncio
import random
import uuid

import msgspec
import pytest
import zmq

from protocol.addresses import default_addresses
from protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    FrontendHello,
    Heartbeat,
    Outputs,
    SamplingParams,
    SchedulerHello,
    SchedulerInfo,
    SchedulerToFrontend,
    StepInput,
    WorkerReady,
    WorkerToScheduler,
)
from tests.faults.conftest import assert_pool_empty, wait_metrics
from tests.faults.raw import ENCODE, bound_router, dealer
from tests.servers import new_server, start_server
from tests.tiny_model import make_tiny_llama

pytestmark = pytest.mark.slow

BAD = "nanoserve:scheduler_bad_messages_total"


def _garbage(seed: int, valid: bytes, wrong_type: bytes, other_version: bytes) -> list[list[bytes]]:
    """Every kind of bad multipart message a DEALER can send, seeded."""
    rng = random.Random(seed)
    return [[rng.randbytes(rng.randint(1, 200))] for _ in range(5)] + [
        [b""],
        [valid[: len(valid) // 2]],  # truncated
        [valid, valid],  # one frame too many
        [wrong_type],
        [other_version],
        [ENCODE([1, 2, 3])],  # msgpack, but no message at all
    ]


async def test_garbage_to_the_scheduler_is_counted_and_dropped(server):
    before = (await wait_metrics(server, lambda m: BAD in m))[BAD]
    addresses = default_addresses(server.run_id)
    params = SamplingParams(max_tokens=2)
    add = ENCODE(AddRequest(request_id="raw-1", prompt_token_ids=[1, 2], params=params))
    ready = WorkerReady(
        protocol_version=99,
        model_id="x",
        num_blocks=1,
        block_size=16,
        num_slots=1,
        max_model_len=32,
        eos_token_ids=[],
        vocab_size=10,
    )
    to_frontends = _garbage(
        1,
        add,
        ENCODE(StepInput(step_id=0, items=[])),
        ENCODE(FrontendHello(protocol_version=99, frontend_id="old")),
    )
    to_workers = _garbage(2, ENCODE(ready), add, ENCODE(ready))
    context = zmq.Context()
    try:
        frontend = dealer(context, addresses.frontend)
        worker = dealer(context, addresses.worker)
        for frames in to_frontends:
            frontend.send_multipart(frames)
        for frames in to_workers:
            worker.send_multipart(frames)
        expected = before + len(to_frontends) + len(to_workers)
        await wait_metrics(server, lambda m: m[BAD] == expected, timeout=10.0)
        # A well-formed request the worker could not run (a token outside the vocabulary)
        # is refused with an error, never forwarded to the worker.
        poison = AddRequest(request_id="raw-2", prompt_token_ids=[10**9], params=params)
        frontend.send(ENCODE(poison))
        decoder = msgspec.msgpack.Decoder(SchedulerToFrontend)
        reply = None
        for _ in range(50):  # the scheduler also sends this peer heartbeats and stats now
            if not frontend.poll(5000):
                break
            message = decoder.decode(frontend.recv())
            if isinstance(message, Outputs) and message.outputs:
                reply = message.outputs[0]
                break
        assert reply is not None and reply.request_id == "raw-2"
        assert reply.finish_reason == "error" and "token ids" in reply.error
    finally:
        context.destroy(linger=0)
    assert (await asyncio.to_thread(server.get, "/health"))[0] == 200
    await assert_pool_empty(server)
    assert "dropped a bad message" in (server.log_dir / "scheduler.log").read_text()


def test_garbage_to_the_worker_is_dropped_and_it_keeps_answering(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny")
    run_id = f"g{uuid.uuid4().hex[:8]}"
    addresses = default_addresses(run_id)
    context = zmq.Context()
    router = bound_router(context, addresses.worker)
    log = tmp_path / "worker.log"
    alone = new_server(tmp_path, run_id)
    worker = alone.start("worker", "--model", str(model), "--num-blocks", "8", "--num-slots", "2")
    decoder = msgspec.msgpack.Decoder(WorkerToScheduler)
    try:
        if not router.poll(60_000):
            raise AssertionError(f"the worker never announced itself\n{log.read_text()}")
        peer, payload = router.recv_multipart()
        assert isinstance(decoder.decode(payload), WorkerReady)
        hello = ENCODE(SchedulerHello())
        wrong = ENCODE(Heartbeat(sender="x", time=0.0))
        garbage = _garbage(3, hello, wrong, ENCODE(SchedulerHello(protocol_version=99)))
        for frames in garbage:
            router.send_multipart([peer, *frames])
        router.send_multipart([peer, hello])
        answer = None
        while router.poll(30_000):
            _, payload = router.recv_multipart()
            answer = decoder.decode(payload)
            if isinstance(answer, WorkerReady):
                break
        assert isinstance(answer, WorkerReady), log.read_text()
        assert worker.poll() is None
        text = log.read_text()
        assert f"dropped bad message #{len(garbage)} " in text  # the version one counted too
        assert "a scheduler speaking protocol 99" in text
    finally:
        alone.stop()
        context.destroy(linger=0)
    assert worker.returncode == 0


def test_garbage_to_the_frontend_is_counted_and_it_keeps_serving(tmp_path):
    run_id = f"g{uuid.uuid4().hex[:8]}"
    addresses = default_addresses(run_id)
    context = zmq.Context()
    router = bound_router(context, addresses.frontend)
    frontend = start_server(tmp_path, roles=("frontend",), run_id=run_id)
    try:
        if not router.poll(60_000):
            raise AssertionError(f"the frontend never said hello\n{frontend.logs()}")
        peer = router.recv_multipart()[0]
        info = SchedulerInfo(
            protocol_version=PROTOCOL_VERSION,
            worker_ready=True,
            model_id="m",
            max_model_len=64,
            num_blocks=8,
            block_size=16,
        )
        garbage = _garbage(
            4,
            ENCODE(info),
            ENCODE(AddRequest(request_id="x", prompt_token_ids=[1], params=SamplingParams())),
            ENCODE(msgspec.structs.replace(info, protocol_version=99)),
        )
        for frames in garbage:
            router.send_multipart([peer, *frames])
        router.send_multipart([peer, ENCODE(info)])
        frontend.wait_healthy(60.0)  # keeps the scheduler "alive": it heard from it just now
        counted = frontend.metrics()["nanoserve:bad_messages_total"]
        assert counted == len(garbage) - 1  # another version decodes, and is refused instead
        assert (
            f"scheduler protocol 99 != frontend protocol {PROTOCOL_VERSION}"
            in (tmp_path / "frontend.log").read_text()
        )
        frontend.check_alive()
    finally:
        frontend.stop()
        context.destroy(linger=0)
