"""Engine.fit: the scheduler process's one engine, sized by the first worker's announcement and
refitted to each worker that replaces a lost one; and WorkerSide adopting workers with it."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import SamplingParams, WorkerReady
from scheduler.block_allocator import BlockAllocator
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.errors import RequestRejected
from scheduler.scheduler import Scheduler
from scheduler.sim_worker import SimWorker
from scheduler.sizing import build_scheduler
from scheduler.worker_side import WorkerSide
from tests.scheduler.conftest import GREEDY, assert_all_back, prompts

CONFIG = SchedulerConfig(token_budget=64, watermark_blocks=0, audit=True)


def _outputs(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished() or engine.num_in_flight:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_an_engine_without_a_worker_refuses_requests_until_one_fits_it() -> None:
    engine = Engine(None, CONFIG)
    with pytest.raises(RequestRejected, match="no worker has announced itself yet"):
        engine.add_request("r", [1, 2], GREEDY)
    assert not engine.fitted and not engine.has_unfinished() and engine.plan() is None
    assert engine.abort("r") is None
    stats = engine.stats()
    assert not stats.worker_ready and stats.kv_blocks_total == 0
    engine.worker = SimWorker(10, 4, 3)
    assert engine.fit(engine.worker.ready()) == []
    engine.add_request("r", [1, 2], GREEDY)
    assert len(_outputs(engine)["r"]) == GREEDY.max_tokens
    assert engine.stats().kv_blocks_total == 10
    assert_all_back(engine)


def test_a_successor_of_the_same_geometry_takes_the_requests_over() -> None:
    """Running requests go back to waiting and finish with the text they would have had."""
    expected = Engine.for_worker(SimWorker(16, 4, 3), CONFIG).generate(prompts(3), GREEDY)
    engine = Engine.for_worker(SimWorker(16, 4, 3), CONFIG)
    for i, prompt in enumerate(prompts(3)):
        engine.add_request(f"gen-{i}", prompt, GREEDY)
    first = {o.request_id: list(o.new_token_ids) for o in engine.step()}
    assert engine.num_in_flight and engine.scheduler.running
    engine.worker = SimWorker(16, 4, 3)  # the lost worker's rows are gone with it
    assert engine.fit(engine.worker.ready()) == []
    assert not engine.num_in_flight and not engine.scheduler.running
    rest = _outputs(engine)
    assert [first.get(f"gen-{i}", []) + rest[f"gen-{i}"] for i in range(3)] == [
        o.new_token_ids for o in expected
    ]
    assert_all_back(engine)


def test_a_successor_of_another_geometry_ends_every_request_and_starts_afresh() -> None:
    engine = Engine.for_worker(SimWorker(16, 4, 3), CONFIG)
    for i, prompt in enumerate(prompts(4)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    engine.worker = SimWorker(16, 8, 3)  # another block size
    ended = engine.fit(engine.worker.ready())
    assert sorted(o.request_id for o in ended) == ["r0", "r1", "r2", "r3"]
    assert {(o.finish_reason, o.error) for o in ended} == {
        ("error", "the worker was replaced by one with a different model or cache")
    }
    assert not engine.has_unfinished() and not engine.num_in_flight
    assert engine.scheduler.allocator.block_size == 8 and engine.ready_info.block_size == 8
    engine.add_request("after", prompts(1)[0], GREEDY)
    assert len(_outputs(engine)["after"]) == GREEDY.max_tokens
    assert_all_back(engine)


def test_a_worker_that_does_not_fit_the_config_changes_nothing() -> None:
    engine = Engine.for_worker(SimWorker(16, 4, 3), SchedulerConfig(num_slots=3))
    engine.add_request("r", [1, 2, 3], GREEDY)
    scheduler, ready = engine.scheduler, engine.ready_info
    with pytest.raises(ValueError, match="num_slots 3 > the worker's 2"):
        engine.fit(SimWorker(16, 8, 2).ready())
    assert engine.scheduler is scheduler and engine.ready_info is ready
    assert engine.scheduler.known_ids == {"r"}


@pytest.mark.parametrize(
    ("config", "allocator", "message"),
    [
        (SchedulerConfig(num_slots=4), None, "num_slots 4 > the worker's 3"),
        (SchedulerConfig(num_blocks=17), None, "num_blocks 17 > the worker's 16"),
        (SchedulerConfig(), BlockAllocator(17, 4), "allocator's geometry does not fit"),
        (SchedulerConfig(), BlockAllocator(16, 8), "allocator's geometry does not fit"),
    ],
)
def test_sizing_refuses_what_the_worker_does_not_have(config, allocator, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_scheduler(SimWorker(16, 4, 3).ready(), config, allocator)


def test_a_scheduler_needs_a_token_budget() -> None:
    with pytest.raises(ValueError, match="need token_budget >= 1, got 0"):
        Scheduler(BlockAllocator(4, 4), num_slots=1, token_budget=0)


class _Recording:
    """A stand-in for the worker's channel: it keeps what was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, bytes]] = []

    def send(self, message: object, peer: bytes) -> None:
        self.sent.append((message, peer))


def test_the_worker_side_fits_the_process_engine_it_was_handed() -> None:
    engine = Engine(None, SchedulerConfig(num_slots=3))
    workers = WorkerSide(_Recording(), engine)  # type: ignore[arg-type]
    assert workers.engine is None and not workers.accepts_requests()
    misfit = SimWorker(16, 4, 2).ready()
    assert workers.on_message(b"small", misfit, None) is None
    assert workers.bad_messages == 1 and workers.worker is None and not engine.fitted
    ready: WorkerReady = msgspec.structs.replace(SimWorker(16, 4, 3).ready(), plan={"a": "b"})
    news = workers.on_message(b"w", ready, None)
    assert news is not None and news.changed and not news.outputs
    assert workers.engine is engine and engine.ready_info is ready
    assert workers.accepts_requests() and workers.worker.peer == b"w"
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    workers.send_steps()
    assert [to for _, to in workers.channel.sent] == [b"w", b"w"]  # two steps in flight
    assert workers.steps_in_flight == 2
    workers.lost("a test")
    assert workers.steps_in_flight == 0 and workers.lost_since is not None
    assert workers.accepts_requests()  # requests wait for a worker to come back
