"""FrontendSide.publish: what the frontends hear after a worker event, and in which order."""

from __future__ import annotations

import time

from protocol.messages import Outputs, SchedulerInfo
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.frontend_side import FrontendSide
from scheduler.worker_side import WorkerSide


class Recording:
    """A stand-in for the frontends' channel: it keeps (message, peer) in the order sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, bytes]] = []

    def send(self, message: object, peer: bytes) -> None:
        self.sent.append((message, peer))


def test_a_frontend_hears_why_before_its_requests_fail():
    """A client that reads its failed request and then asks /health must get the same reason,
    so each frontend gets the new SchedulerInfo before the failures."""
    channel = Recording()
    engine = Engine(None, SchedulerConfig())
    workers = WorkerSide(channel=None, engine=engine)  # type: ignore[arg-type]
    frontends = FrontendSide(channel, engine, workers)  # type: ignore[arg-type]
    for peer in (b"a", b"b"):
        frontends.peers.heard(peer, time.monotonic(), None)
    frontends.owner.update({"r1": b"a", "r2": b"b", "r3": b"a"})
    reason = "no worker came back within 60 s"

    frontends.publish(workers.give_up(reason))

    for peer in (b"a", b"b"):
        heard = [message for message, to in channel.sent if to == peer]
        assert [type(message) for message in heard] == [SchedulerInfo, Outputs]
        info, outputs = heard
        assert not info.worker_ready and info.reason == reason
        assert {output.error for output in outputs.outputs} == {reason}
    failed = [o.request_id for m, _ in channel.sent if isinstance(m, Outputs) for o in m.outputs]
    assert sorted(failed) == ["r1", "r2", "r3"] and not frontends.owner
