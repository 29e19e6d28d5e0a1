"""Peers on another protocol version refuse each other by name, over real sockets. A real
scheduler process refuses a frontend's hello and a worker's announcement of another version: one
error line each, no SchedulerInfo for the frontend, no adoption of the worker, while peers of its
own version are served. (The frontend's side of the refusal: tests/frontend/test_faults.py; the
worker's: tests/faults/test_garbage.py.)"""

from __future__ import annotations

import zmq

from protocol.addresses import default_addresses
from protocol.messages import (
    PROTOCOL_VERSION,
    FrontendHello,
    SchedulerInfo,
    SchedulerToFrontend,
    SchedulerToWorker,
    StepInput,
)
from tests.faults.raw import ENCODE, announcement, dealer, first_info, received

OTHER = PROTOCOL_VERSION - 1


def test_the_scheduler_refuses_a_frontend_on_another_version(lone_scheduler):
    addresses = default_addresses(lone_scheduler.run_id)
    refused = (
        f"frontend old-frontend speaks protocol {OTHER}, this scheduler {PROTOCOL_VERSION}: ignored"
    )
    context = zmq.Context()
    try:
        old = dealer(context, addresses.frontend)
        old.send(ENCODE(FrontendHello(protocol_version=OTHER, frontend_id="old-frontend")))
        lone_scheduler.wait_log("scheduler", refused, timeout=30.0)
        # An answer would have gone out with the log line; heartbeats and gauges may follow.
        answers = received(old, SchedulerToFrontend, 1.5)
        assert not [m for m in answers if isinstance(m, SchedulerInfo)], answers
        current = dealer(context, addresses.frontend)
        hello = FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id="new-frontend")
        current.send(ENCODE(hello))
        info = first_info(current)
        assert info.protocol_version == PROTOCOL_VERSION and not info.worker_ready
        assert info.reason == "no worker has announced itself yet"
    finally:
        context.destroy(linger=0)
    log = (lone_scheduler.log_dir / "scheduler.log").read_text()
    assert log.count(refused) == 1 and "ERROR" in log.split(refused)[0].splitlines()[-1]
    lone_scheduler.check_alive()


def test_the_scheduler_refuses_a_worker_on_another_version(lone_scheduler):
    addresses = default_addresses(lone_scheduler.run_id)
    refused = f"speaks protocol {OTHER}, this scheduler {PROTOCOL_VERSION}: ignored"
    context = zmq.Context()
    try:
        frontend = dealer(context, addresses.frontend)
        hello = FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id="watcher")
        frontend.send(ENCODE(hello))
        assert not first_info(frontend).worker_ready
        old = dealer(context, addresses.worker, identity=b"old-worker")
        old.send(ENCODE(announcement(OTHER)))
        lone_scheduler.wait_log("scheduler", rf"worker b'old-worker' {refused}", timeout=30.0)
        news = received(frontend, SchedulerToFrontend, 1.0)
        assert not [m for m in news if isinstance(m, SchedulerInfo)], news  # nothing changed
        # The same announcement in this version is adopted, and every frontend hears of it.
        current = dealer(context, addresses.worker, identity=b"new-worker")
        current.send(ENCODE(announcement(PROTOCOL_VERSION)))
        info = first_info(frontend)
        assert info.worker_ready and info.model_id == "raw" and info.num_blocks == 8
        steps = received(old, SchedulerToWorker, 0.5)
        assert not [m for m in steps if isinstance(m, StepInput)]
    finally:
        context.destroy(linger=0)
    log = (lone_scheduler.log_dir / "scheduler.log").read_text()
    assert log.count(refused) == 1
    lone_scheduler.check_alive()
