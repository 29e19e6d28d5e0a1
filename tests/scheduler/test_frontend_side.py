"""FrontendSide: what the frontends hear after a worker event, in which order, and when the
gauges come with it."""

from __future__ import annotations

import time

import msgspec

from protocol.messages import EngineStats, Heartbeat, Outputs, RequestOutput, SchedulerInfo
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.frontend_side import FrontendSide
from scheduler.worker_side import WorkerNews, WorkerSide


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


def _gauges(stats: EngineStats | None) -> EngineStats | None:
    """``stats`` but the process's CPU time, which moves between two reads."""
    return stats and msgspec.structs.replace(stats, scheduler_cpu_s_total=0.0)


def test_the_gauges_ride_the_heartbeat_and_the_outputs_that_end_a_request():
    channel = Recording()
    engine = Engine(None, SchedulerConfig())
    workers = WorkerSide(channel=None, engine=engine)  # type: ignore[arg-type]
    frontends = FrontendSide(channel, engine, workers)  # type: ignore[arg-type]
    for peer in (b"a", b"b"):
        frontends.peers.heard(peer, time.monotonic(), None)
    frontends.owner.update({"r1": b"a", "r2": b"b"})

    frontends.heartbeat()
    assert [(type(m), to) for m, to in channel.sent] == [(Heartbeat, b"a"), (Heartbeat, b"b")]
    assert all(_gauges(m.stats) == _gauges(frontends.stats()) for m, _ in channel.sent)
    channel.sent.clear()
    frontends.publish(
        WorkerNews(
            outputs=[
                RequestOutput(request_id="r1", new_token_ids=[5]),
                RequestOutput(request_id="r2", new_token_ids=[6], finish_reason="length"),
            ]
        )
    )
    sent = {to: message for message, to in channel.sent}
    assert sent[b"a"].stats is None  # a token on its way: the gauges wait for the beat
    assert _gauges(sent[b"b"].stats) == _gauges(frontends.stats())  # r2 ended: at once
    assert frontends.owner == {"r1": b"a"}
