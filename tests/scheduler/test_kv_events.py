"""KV events from the prefix cache (``KvEventLog``), in process on the SimWorker: replaying the
events after every step rebuilds exactly the index's set of hashes through a multi-turn run
with evictions, a lost worker and a replaced pool; and recording changes nothing the cache does.
The wire and the sockets are ``tests/faults/test_kv_events.py``'s."""

from __future__ import annotations

import random

import pytest

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, as_map, external_hash
from protocol.messages import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.kv_events import KvEventLog
from scheduler.sim_worker import SimWorker

TURN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(events: bool, num_blocks: int = 40) -> Engine:
    config = SchedulerConfig(
        token_budget=64,
        watermark_blocks=0,
        audit=True,
        kv_events_endpoint="ipc://never-bound" if events else None,
    )
    return Engine.for_worker(SimWorker(num_blocks, 4, 4), config)


class Replica:
    """What a subscriber knows: the hashes stored and not since removed or cleared, and what
    made no sense (a parent never stored, a removal of a hash it does not hold)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.stored = 0
        self.problems: list[str] = []

    def apply(self, events: list) -> None:
        for event in events:
            match event:
                case BlockStored(block_hashes=hashes, parent_block_hash=parent):
                    if parent is not None and parent not in self.hashes:
                        self.problems.append(f"block {hashes[0]} stored after an unknown parent")
                    self.hashes.update(hashes)
                    self.stored += len(hashes)
                case BlockRemoved(block_hashes=hashes):
                    missing = set(hashes) - self.hashes
                    if missing:
                        self.problems.append(f"removed {sorted(missing)} never stored")
                    self.hashes.difference_update(hashes)
                case AllBlocksCleared():
                    self.hashes.clear()


def disagreement(replica: Replica, engine: Engine) -> str | None:
    """How the replica's hashes differ from the scheduler's index, or None."""
    index = {external_hash(digest) for digest in engine.scheduler.allocator.hash_index}
    if replica.hashes == index:
        return None
    return (
        f"{len(index - replica.hashes)} cached hashes never stored, "
        f"{len(replica.hashes - index)} stored hashes no longer cached"
    )


def multi_turn(engine: Engine, on_step, conversations: int = 6, turns: int = 4) -> list:
    """Conversations on one shared system prompt, all of a turn's requests at once; each turn
    resends the history with the reply and a new user message. Returns every reply."""
    rng = random.Random(7)
    system = [rng.randrange(1, 900) for _ in range(13)]
    histories = [list(system) for _ in range(conversations)]
    replies = []
    for turn in range(turns):
        for c, history in enumerate(histories):
            history += [rng.randrange(1, 900) for _ in range(5)]
            engine.add_request(f"c{c}t{turn}", list(history), TURN)
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
            on_step()
        for c, history in enumerate(histories):
            history += outputs[f"c{c}t{turn}"]
            replies.append(outputs[f"c{c}t{turn}"])
    return replies


def test_replaying_the_events_rebuilds_the_index_after_every_step() -> None:
    engine, replica = _engine(events=True), Replica()
    evictions = []

    def check() -> None:
        events = engine.kv_events.take()
        evictions.extend(e for e in events if isinstance(e, BlockRemoved))
        replica.apply(events)
        assert disagreement(replica, engine) is None and replica.problems == []

    multi_turn(engine, check)
    assert evictions, "the pool is small enough that the run evicts"
    assert replica.hashes and replica.stored > len(replica.hashes)


def test_recording_changes_nothing_the_cache_does() -> None:
    """The same run with and without events: the same replies, and the same ledgers after."""
    quiet, recorded = _engine(events=False), _engine(events=True)
    assert multi_turn(quiet, lambda: None) == multi_turn(recorded, recorded.kv_events.take)
    a, b = quiet.scheduler, recorded.scheduler
    assert a.allocator.hash_index == b.allocator.hash_index
    assert a.allocator.eviction_queue == b.allocator.eviction_queue
    assert bytes(a.allocator.block_states) == bytes(b.allocator.block_states)
    assert (a.cache.queries, a.cache.hits) == (b.cache.queries, b.cache.hits)


def test_a_lost_worker_clears_every_block() -> None:
    engine, replica = _engine(events=True), Replica()
    multi_turn(engine, lambda: replica.apply(engine.kv_events.take()), turns=1)
    assert replica.hashes
    engine.worker_lost()
    events = engine.kv_events.take()
    assert events == [AllBlocksCleared()]
    replica.apply(events)
    assert replica.hashes == set() and disagreement(replica, engine) is None


def test_a_replaced_pool_starts_from_a_clear_and_keeps_recording() -> None:
    """A new worker of another geometry: its scheduler is new, and so is its empty index."""
    engine, replica = _engine(events=True), Replica()
    multi_turn(engine, lambda: replica.apply(engine.kv_events.take()), turns=1)
    engine.worker = SimWorker(40, 8, 4)  # another block size: a fresh scheduler
    engine.fit(engine.worker.ready())
    replica.apply(engine.kv_events.take())
    assert replica.hashes == set()
    multi_turn(engine, lambda: replica.apply(engine.kv_events.take()), turns=1)
    assert replica.hashes and disagreement(replica, engine) is None


def test_a_stored_event_carries_its_blocks_tokens_and_parent() -> None:
    log, digests = KvEventLog(), [bytes([i]) * 32 for i in range(3)]
    log.stored(digests[1:], digests[0], list(range(8)), 4)
    (event,) = log.take()
    assert event.block_hashes == [external_hash(d) for d in digests[1:]]
    assert event.parent_block_hash == external_hash(digests[0])
    assert (event.token_ids, event.block_size, event.medium) == (list(range(8)), 4, "GPU")
    log.removed(digests[2])
    log.removed(digests[1])
    log.cleared()
    assert log.take() == [
        BlockRemoved(
            block_hashes=[external_hash(digests[2]), external_hash(digests[1])], medium="GPU"
        ),
        AllBlocksCleared(),
    ]
    assert log.take() == []


@pytest.mark.parametrize(
    "lose, message",
    [("stored", "cached hashes never stored"), ("removed", "stored hashes no longer cached")],
)
def test_the_comparison_fires_on_one_lost_event(lose: str, message: str) -> None:
    """Drop the first event of one kind: the very step it belonged to is found wrong, by name."""
    engine, replica = _engine(events=True), Replica()
    kind = BlockStored if lose == "stored" else BlockRemoved
    found: list[str | None] = []

    def apply_but_one() -> None:
        events = engine.kv_events.take()
        victim = next((e for e in events if isinstance(e, kind)), None)
        if victim is None or found:
            replica.apply(events)
            return
        events.remove(victim)
        replica.apply(events)
        found.append(disagreement(replica, engine))
        replica.apply([victim])  # back in step, so the run goes on

    multi_turn(engine, apply_but_one)
    assert found and message in str(found[0]), found


def test_the_map_form_is_vllms_newer_tagged_map() -> None:
    """What vLLM's newer releases (and vllm-router) read: each event a map tagged "type"."""
    log, digest = KvEventLog(), bytes(range(32))
    log.stored([digest], None, [1, 2, 3, 4], 4)
    log.removed(digest)
    log.cleared()
    stored, removed, cleared = (as_map(event) for event in log.take())
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [int.from_bytes(digest[-8:], "big")],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": stored["block_hashes"],
        "medium": "GPU",
    }
    assert cleared == {"type": "AllBlocksCleared"}
