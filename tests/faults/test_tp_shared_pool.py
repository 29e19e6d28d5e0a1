"""A tensor-parallel group of three ranks over the pool holder's shared pools (one per rank):
a SIGKILLed rank mid-generation ends the group as any rank's death does, the supervisor restarts
it, every new rank attaches to its own rank's pool at the next generation, and the scheduler
re-attaches the group: every stream ends with the undisturbed text, and only the tokens of the
steps in flight are computed again. Bytes flipped in one rank's pool are caught by the leader's
checksum, which covers every rank's shard, named (block, request) and recomputed. Real
processes, the default model in float32, the audit on."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import aiohttp
import pytest

from tests.faults.conftest import _report_timings, assert_pool_empty, record, start_streams
from tests.faults.test_shared_pool import body, flip_block, long_prompt, running_blocks
from tests.faults.test_tensor_parallel import _kill_group
from tests.servers import ROLES, Server, children, server_fixture

# Serial: a group of three float32 ranks, its holder and a stack beside another test process's
# servers needs more memory than the two-process pass leaves.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

SIZE = 3  # SmolLM2-135M: 9 query heads, 3 KV heads: one KV head a rank


def _stop(server: Server) -> None:
    _kill_group(server)
    _report_timings(server)


tp_pool_server = server_fixture(
    after_stop=_stop,
    roles=("kv-holder", *ROLES),
    supervised=("kv-holder", "scheduler", "worker"),
    audit=1,
    dtype="float32",
    shared_kv_pool=1,
    tensor_parallel_size=SIZE,
    num_blocks=512,
    num_slots=16,
    threads=1,
)

PROMPTS = [long_prompt(40 + i, words=250) for i in range(4)]  # about 300 tokens each


async def _calm(session, server: Server, salt: str):
    streams, tasks = start_streams(session, server, [body(p, salt) for p in PROMPTS])
    await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
    assert all(s.done and not s.errors and s.text for s in streams), server.logs()
    return streams


async def _until_tokens(server: Server, streams, tasks, count: int = 3) -> None:
    deadline = time.monotonic() + 300.0
    while not all(len(s.times) >= count for s in streams):
        if time.monotonic() > deadline or any(t.done() for t in tasks):
            raise AssertionError(f"streams did not start\n{server.logs()}")
        await asyncio.sleep(0.01)


def _a_follower(server: Server) -> tuple[int, list[int]]:
    """A rank other than 0 (a child of the leader), and the whole group's pids."""
    leader = server.child_pid("worker")
    ranks = children(leader)
    assert len(ranks) == SIZE - 1, ranks
    return ranks[0], [leader, *ranks]


def _group_pools(log: str) -> list[str]:
    """The leader's lines naming every rank's pool and generation."""
    return re.findall(r"the group's pools: (.*)", log)


async def test_a_sigkilled_rank_reattaches_the_group(tp_pool_server):
    server = tp_pool_server
    async with aiohttp.ClientSession() as session:
        calm = await _calm(session, server, "tp-calm")
        before = await asyncio.to_thread(server.metrics)
        mark, worker_mark = server.log_size("scheduler"), server.log_size("worker")
        streams, tasks = start_streams(session, server, [body(p, "tp-kill") for p in PROMPTS])
        await _until_tokens(server, streams, tasks)
        rank, group = _a_follower(server)
        killed = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        counts = [len(s.times) for s in streams]
        assert not any(t.done() for t in tasks), "the kill came after the streams ended"
        await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
    gaps = [s.times[c] - killed for s, c in zip(streams, counts, strict=True) if len(s.times) > c]
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text
    assert server.child_pid("worker") != group[0]  # a new group, not the old one
    metrics = await assert_pool_empty(server)
    reattaches = "nanoserve:kv_pool_reattaches_total"
    assert metrics[reattaches] == before[reattaches] + 1, server.logs()
    fallbacks = {k: v for k, v in metrics.items() if k.startswith("nanoserve:kv_pool_fallbacks")}
    assert fallbacks == {k: v for k, v in before.items() if k in fallbacks}, fallbacks
    # Two steps in flight at most (overlap), one decode token a stream in each.
    recomputed = metrics["nanoserve:worker_restart_tokens_recomputed_last"]
    assert 0 < recomputed <= 2 * len(PROMPTS), recomputed
    log = (server.log_dir / "scheduler.log").read_bytes()[mark:]
    assert b"did not re-attach" not in log and b"re-attached" in log, server.logs()
    [pools] = _group_pools((server.log_dir / "worker.log").read_text()[worker_mark:])
    generations = re.findall(r"rank (\d) \w+ generation (\d+)", pools)
    assert [rank for rank, _ in generations] == ["0", "1", "2"], pools
    # Every rank on its own pool's next generation (each pool's first group attached once).
    assert len({generation for _, generation in generations}) == 1, pools
    assert int(generations[0][1]) > 1, pools
    record("tp_shared_pool_rank_kill_to_next_token_max", max(gaps))
    record("tp_shared_pool_tokens_recomputed", recomputed)


async def test_a_corrupted_block_of_one_ranks_pool_is_named_and_recomputed(tp_pool_server):
    server = tp_pool_server
    async with aiohttp.ClientSession() as session:
        calm = await _calm(session, server, "tpc-calm")
        before = await asyncio.to_thread(server.metrics)
        mark = server.log_size("scheduler")
        streams, tasks = start_streams(session, server, [body(p, "tpc-kill") for p in PROMPTS])
        await _until_tokens(server, streams, tasks)
        rows = await asyncio.to_thread(running_blocks, server.run_id)
        victim, blocks = next(iter(rows.items()))
        rank, _ = _a_follower(server)
        os.kill(rank, signal.SIGKILL)
        flip_block(server.run_id, blocks[0], rank=2)  # before the new group maps the pools
        await asyncio.wait_for(asyncio.gather(*tasks), 600.0)
    for after, undisturbed in zip(streams, calm, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == undisturbed.text  # no token came from the flipped bytes
    log = (server.log_dir / "scheduler.log").read_bytes()[mark:].decode()
    assert f"KV block {blocks[0]} fails its checksum after the re-attach (held by {victim}" in (
        log
    ), server.logs()
    metrics = await assert_pool_empty(server)
    reattaches = "nanoserve:kv_pool_reattaches_total"
    assert metrics[reattaches] == before[reattaches] + 1, server.logs()
