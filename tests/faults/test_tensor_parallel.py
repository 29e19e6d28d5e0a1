"""A worker of three ranks (gloo on CPU) serving the default model in float32, its ranks
supervised together: chat and completion prompts give the text of one rank through the HTTP
API, and a SIGKILLed non-zero rank in the middle of streams is the worker's death. The scheduler
notices, the other ranks exit with it, the supervisor restarts the group, every stream finishes
with the undisturbed text, no process of the old group is left behind and /health recovers."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.faults.conftest import (
    MODEL,
    Stream,
    assert_pool_empty,
    record,
    start_streams,
    stream_completion,
    wait_until,
)
from tests.servers import Server, alive, children, server_fixture

pytestmark = pytest.mark.slow

SIZE = 3  # SmolLM2-135M: 9 query heads, 3 KV heads
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
COMPLETIONS = ["Once upon a time"]
BODY = {"max_tokens": 32, "temperature": 0}


def _kill_group(server: Server) -> None:
    """The supervisor is gone; its worker leader and the leader's ranks must be too."""
    try:
        leader = int(server.pid_file("worker").read_text())
    except (OSError, ValueError):
        return
    for pid in [*children(leader), leader]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


ranks = server_fixture(
    after_stop=_kill_group,
    supervised=("worker",),
    audit=1,
    dtype="float32",
    tensor_parallel_size=SIZE,
    num_blocks=512,
    num_slots=16,
    threads=1,
)


async def _chat(session: aiohttp.ClientSession, server: Server, question: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], **BODY}
    async with session.post(server.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["message"]["content"]


async def _texts(server: Server) -> list[str]:
    async with aiohttp.ClientSession() as session:
        chats = [_chat(session, server, q) for q in CHATS]
        streams = [
            stream_completion(session, server, {**BODY, "prompt": p}, Stream()) for p in COMPLETIONS
        ]
        done = await asyncio.gather(*chats, *streams)
    return [*done[: len(CHATS)], *(s.text for s in done[len(CHATS) :])]


async def test_three_ranks_answer_the_readme_prompts_as_one(server, ranks):
    one, three = await _texts(server), await _texts(ranks)
    assert all(one) and three == one


STORIES = [f"Write a short story about a robot named Unit {i}." for i in range(3)]
LONG = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}


async def test_a_sigkilled_rank_is_the_workers_death(ranks):
    server = ranks
    async with aiohttp.ClientSession() as session:
        calm = await asyncio.gather(
            *[stream_completion(session, server, {**LONG, "prompt": p}, Stream()) for p in STORIES]
        )
        assert all(s.done and not s.errors and s.text for s in calm)
        leader = server.child_pid("worker")
        group = [leader, *children(leader)]
        assert len(group) == SIZE, group
        streams, tasks = start_streams(session, server, [{**LONG, "prompt": p} for p in STORIES])
        await wait_until(lambda: all(len(s.times) >= 2 for s in streams), what="first tokens")
        mark = server.log_size("scheduler")
        killed = time.monotonic()
        os.kill(group[1], signal.SIGKILL)
        assert not any(s.done for s in streams), "the kill came after the streams ended"
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker lost", mark, 5.0)
        record("tp_rank_kill_to_detected", time.monotonic() - killed)
        await wait_until(lambda: not any(map(alive, group)), 10.0, "the old ranks gone")
        record("tp_rank_kill_to_old_group_gone", time.monotonic() - killed)
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker ready", mark, 180.0)
        record("tp_rank_kill_to_group_ready", time.monotonic() - killed)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180.0)
    for before, after in zip(calm, results, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == before.text
    new_leader = server.child_pid("worker", other_than=leader)
    assert new_leader != leader and len(children(new_leader)) == SIZE - 1
    await asyncio.to_thread(server.wait_healthy, 30.0)
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:scheduler_workers_lost_total"] >= 1
