"""A worker SIGKILLed mid-generation costs recompute, not requests: the scheduler notices at
once, its supervisor restarts it, the streams continue and greedy text equals an undisturbed
run. Without a worker for --worker-timeout, requests fail clearly and /health says why; a worker
with another cache geometry fails the requests it cannot carry over."""

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
    stream_completion,
    wait_until,
)
from tests.servers import start_server

pytestmark = pytest.mark.slow

PROMPTS = [f"Write a short story about a robot named Unit {i}." for i in range(4)]
BODY = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}


async def test_sigkilled_worker_is_recomputed_and_streams_match(server):
    async with aiohttp.ClientSession() as session:
        undisturbed = await asyncio.gather(
            *[stream_completion(session, server, {**BODY, "prompt": p}, Stream()) for p in PROMPTS]
        )
        assert all(s.done and not s.errors and s.text for s in undisturbed)

        streams = [Stream() for _ in PROMPTS]
        tasks = [
            asyncio.create_task(stream_completion(session, server, {**BODY, "prompt": p}, s))
            for p, s in zip(PROMPTS, streams, strict=True)
        ]
        await wait_until(lambda: all(len(s.times) >= 2 for s in streams), what="first tokens")
        pid = server.child_pid("worker")
        mark = server.log_size("scheduler")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        counts = [len(s.times) for s in streams]
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker lost", mark, 5.0)
        record("worker_kill_to_detected", time.monotonic() - killed)
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker ready", mark, 120.0)
        record("worker_kill_to_worker_ready", time.monotonic() - killed)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120.0)

    assert all(len(s.times) < 2 + 94 for s in results), "the kill came after the streams ended"
    resumed = min(s.times[c] for s, c in zip(results, counts, strict=True) if len(s.times) > c)
    record("worker_kill_to_streams_resumed", resumed - killed)
    for before, after in zip(undisturbed, results, strict=True):
        assert after.done and not after.errors, after.errors
        assert after.text == before.text
    metrics = await assert_pool_empty(server)
    assert metrics["nanoserve:scheduler_workers_lost_total"] >= 1
    assert metrics["nanoserve:num_preemptions_total"] >= len(PROMPTS)


@pytest.fixture(scope="module")
def lonely(tmp_path_factory: pytest.TempPathFactory):
    """A server whose worker is not supervised, and whose requests wait 15 s for a worker."""
    running = start_server(tmp_path_factory.mktemp("lonely"), audit=1, worker_timeout=15, threads=1)
    try:
        yield running
    finally:
        running.stop()


async def _kill_worker_mid_stream(server) -> tuple[asyncio.Task, Stream, float]:
    session = aiohttp.ClientSession()
    stream = Stream()
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    task = asyncio.create_task(stream_completion(session, server, body, stream))
    task.add_done_callback(lambda _: asyncio.ensure_future(session.close()))
    await wait_until(lambda: len(stream.times) >= 1, what="first token")
    worker = server.processes["worker"]
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.to_thread(worker.wait, 5.0)
    return task, stream, killed


async def test_another_geometry_fails_what_is_in_flight(lonely):
    task, stream, _ = await _kill_worker_mid_stream(lonely)
    mark = lonely.log_size("scheduler")
    lonely.start("worker", "--num-blocks", "777")
    await asyncio.to_thread(lonely.wait_log, "scheduler", r"worker ready", mark, 120.0)
    await asyncio.wait_for(task, 30.0)
    assert stream.done and len(stream.errors) == 1
    assert "different model or cache" in stream.errors[0]["error"]["message"]
    await asyncio.to_thread(lonely.wait_healthy, 30.0)
    await assert_pool_empty(lonely)


async def test_no_worker_within_the_timeout_fails_clearly(lonely):
    task, stream, killed = await _kill_worker_mid_stream(lonely)
    await asyncio.wait_for(task, 30.0)
    record("worker_timeout_15s_to_stream_error", time.monotonic() - killed)
    assert stream.done and len(stream.errors) == 1
    assert "no worker came back within 15 s" in stream.errors[0]["error"]["message"]
    status, body = await asyncio.to_thread(lonely.get, "/health")
    assert status == 503 and "no worker came back within 15 s" in body
    async with aiohttp.ClientSession() as session:
        async with session.post(
            lonely.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}
        ) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
    lonely.start("worker")
    await asyncio.to_thread(lonely.wait_healthy, 120.0)
    await assert_pool_empty(lonely)


async def test_a_silent_worker_is_dropped_then_readmitted_when_it_speaks(server):
    """The heartbeat backstop: a stopped (not dead) idle worker keeps its connection open, so
    only its silence tells. When it resumes, the scheduler greets it and it re-announces."""
    pid = server.child_pid("worker")
    mark = server.log_size("scheduler")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        await asyncio.to_thread(server.wait_log, "scheduler", r"worker lost \(silent", mark, 5.0)
        record("idle_worker_sigstop_to_detected", time.monotonic() - stopped)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.to_thread(server.wait_log, "scheduler", r"worker ready", mark, 10.0)
    assert server.child_pid("worker") == pid  # the same process, greeted again
    await asyncio.to_thread(server.wait_healthy, 10.0)
    await assert_pool_empty(server)


async def test_a_worker_hung_mid_step_is_dropped_and_its_requests_recomputed(server):
    """SIGSTOP during generation: the heartbeat thread stops too, so the scheduler gives the
    step up; when the worker resumes, its stale result is ignored and it is greeted again."""
    body = {**BODY, "prompt": PROMPTS[1]}
    async with aiohttp.ClientSession() as session:
        undisturbed = await stream_completion(session, server, body, Stream())
        stream = Stream()
        task = asyncio.create_task(stream_completion(session, server, body, stream))
        await wait_until(lambda: len(stream.times) >= 2, what="first tokens")
        pid = server.child_pid("worker")
        mark = server.log_size("scheduler")
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            await asyncio.to_thread(server.wait_log, "scheduler", r"worker lost \(silent", mark, 6)
            record("busy_worker_sigstop_to_detected", time.monotonic() - stopped)
        finally:
            os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(task, 60.0)
    assert stream.done and not stream.errors and stream.text == undisturbed.text
    assert server.child_pid("worker") == pid
    await assert_pool_empty(server)
