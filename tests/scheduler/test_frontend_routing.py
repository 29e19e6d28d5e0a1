"""Routing between several frontends (``--api-servers``): the scheduler's FrontendSide sends
each frontend the outputs of its own requests only, applies a frontend's aborts to its own
requests only, and losing one frontend aborts its requests and no other's. The engine runs on
the model-free SimWorker, audited between iterations."""

from __future__ import annotations

import logging
import time

from protocol.messages import Abort, AddRequest, Outputs
from scheduler.frontend_side import FrontendSide
from scheduler.peers import WorkerPeer
from scheduler.worker_side import WorkerNews, WorkerSide
from tests.scheduler.conftest import GREEDY, make_engine, prompts
from tests.scheduler.test_frontend_side import Recording

A, B = b"frontend-a", b"frontend-b"


def _side() -> tuple[FrontendSide, Recording]:
    """Two frontends, heard from, before a ready worker on an audited engine."""
    engine = make_engine(num_blocks=40, num_slots=4)
    workers = WorkerSide(channel=None, engine=engine)  # type: ignore[arg-type]
    workers.worker = WorkerPeer(peer=b"worker", ready=engine.ready_info, last_seen=0.0)
    channel = Recording()
    side = FrontendSide(channel, engine, workers)  # type: ignore[arg-type]
    for peer in (A, B):
        side.peers.heard(peer, time.monotonic(), None)
    return side, channel


def _add(side: FrontendSide, peer: bytes, request_id: str, prompt: list[int]) -> None:
    side.on_message(
        peer, AddRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY), None
    )


def _run(side: FrontendSide, steps: int | None = None) -> None:
    """Step the engine (all the way, or ``steps`` times) and publish every step's outputs."""
    engine = side.engine
    done = 0
    while engine.has_unfinished() or engine.num_in_flight:
        if steps is not None and done == steps:
            return
        side.publish(WorkerNews(outputs=engine.step()))
        done += 1


def _heard(channel: Recording) -> dict[bytes, dict[str, list]]:
    """Per frontend, per request: the (tokens, finish reason) of every output it was sent."""
    heard: dict[bytes, dict[str, list]] = {A: {}, B: {}}
    for message, peer in channel.sent:
        if isinstance(message, Outputs):
            for output in message.outputs:
                entry = (output.new_token_ids, output.finish_reason)
                heard[peer].setdefault(output.request_id, []).append(entry)
    return heard


def test_each_frontend_hears_only_its_own_requests_whole():
    side, channel = _side()
    ids = {A: ["a0", "a1", "a2"], B: ["b0", "b1", "b2"]}
    for n, (peer, request_id) in enumerate((p, r) for p in ids for r in ids[p]):
        _add(side, peer, request_id, prompts(6)[n])
    _run(side)
    heard = _heard(channel)
    for peer in (A, B):
        assert sorted(heard[peer]) == ids[peer]
        for outputs in heard[peer].values():
            assert sum(len(tokens) for tokens, _ in outputs) == GREEDY.max_tokens
            assert [reason for _, reason in outputs][-1] == "length"
    assert side.owner == {} and side.bad_messages == 0


def test_an_abort_reaches_only_the_senders_own_request(caplog):
    side, channel = _side()
    _add(side, A, "a0", prompts(2)[0])
    _add(side, B, "b0", prompts(2)[1])
    _run(side, steps=2)
    with caplog.at_level(logging.WARNING, logger="nanoserve.scheduler"):
        side.on_message(A, Abort(request_id="b0"), None)  # not A's: dropped
    assert side.bad_messages == 1
    assert "abort of 'b0', another frontend's request" in caplog.text
    assert side.owner == {"a0": A, "b0": B}
    side.on_message(A, Abort(request_id="a0"), None)  # its own: applied
    assert side.owner == {"b0": B}
    sent_to_a = len([1 for _, peer in channel.sent if peer == A])
    _run(side)
    heard = _heard(channel)
    assert [reason for _, reason in heard[B]["b0"]][-1] == "length"  # B's ran to its end
    assert len([1 for _, peer in channel.sent if peer == A]) == sent_to_a  # A heard no more


def test_losing_a_frontend_aborts_its_requests_and_no_others(caplog):
    side, channel = _side()
    for n, (peer, request_id) in enumerate(((A, "a0"), (B, "b0"), (A, "a1"), (B, "b1"))):
        _add(side, peer, request_id, prompts(4)[n])
    _run(side, steps=3)
    with caplog.at_level(logging.WARNING, logger="nanoserve.scheduler"):
        side.lost(A, "its connection closed")
    assert "aborted its 2 requests" in caplog.text
    assert A not in side.peers and B in side.peers
    assert side.owner == {"b0": B, "b1": B}
    assert sorted(side.engine.scheduler.known_ids) == ["b0", "b1"]
    before = len(channel.sent)
    _run(side)
    assert all(peer == B for _, peer in channel.sent[before:])  # nothing goes to the lost one
    heard = _heard(channel)
    for request_id in ("b0", "b1"):
        outputs = heard[B][request_id]
        assert sum(len(tokens) for tokens, _ in outputs) == GREEDY.max_tokens
    assert side.frontends_lost == 1 and side.owner == {}


def test_one_request_id_from_two_frontends_is_refused(caplog):
    side, _ = _side()
    _add(side, A, "same", prompts(1)[0])
    with caplog.at_level(logging.WARNING, logger="nanoserve.scheduler"):
        _add(side, B, "same", prompts(1)[0])
    assert "request id 'same' is already in use" in caplog.text
    assert side.owner == {"same": A} and side.bad_messages == 1
